"""What train uses: its pieces in order (train_inputs, train_run with data_plan, target_head and optim, loop,
checkpoints, exports), the TTT loss, ranks and parallelism, speculators' trainer, metric trackers."""
