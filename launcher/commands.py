"""Commands added by later features register themselves on the app here (kept out of cli.py's core)."""
