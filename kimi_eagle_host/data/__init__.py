"""What the steps read and write: datasets and prompts, the prepared data, hidden-state files, train's packed rows."""
