"""The process executor: persistent worker processes, their dispatcher, tasks, and shared-memory arena."""
