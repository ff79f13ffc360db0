"""The Files API: routes and the files kept on disk."""
