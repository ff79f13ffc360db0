"""Request and response bodies of every route family, as msgspec Structs: the bottom of the API layer."""
