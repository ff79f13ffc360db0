"""Model definitions and weight loading (torch)."""
