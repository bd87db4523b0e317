"""The EAGLE-3 draft model and its speculators-format export."""
