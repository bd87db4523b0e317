"""The host operations the CLI offers besides jobs: render, upload, preflight, deploy-patch, gpu-reset, and a
run's outputs (pull, clean). Each one's host half, where it has one, is kimi_eagle_host/ops/<same name>.py."""
