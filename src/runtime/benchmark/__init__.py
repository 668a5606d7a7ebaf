"""taac-benchmark: every backend of an op side by side with the installed peers."""
