"""What train uses: the TTT loss, ranks and parallelism, speculators' trainer, metric trackers."""
