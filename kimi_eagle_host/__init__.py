"""kimi-eagle's host side: the code that runs on the GPU hosts, uploaded by the controller (kimi_eagle) and run as
modules (`python -m kimi_eagle_host.pipeline.train ...`). It never imports kimi_eagle; its ops/ and step_runtime
use only the stdlib. docs/CONTRACTS.md describes the layout and the step contract."""
