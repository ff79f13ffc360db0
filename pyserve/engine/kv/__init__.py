"""KV memory: the page allocator, the radix prefix cache, and their one owner."""
