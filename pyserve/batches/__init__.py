"""The Batches API: routes, the runner of batch tasks, and batch records on disk."""
