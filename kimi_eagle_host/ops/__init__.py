"""Host operations behind the controller's commands, stdlib only, each named as its controller half: probe,
preflight, deploy_patch, gpu_reset, jobs, clean, provenance."""
