"""The steps' entry points, one module each (python -m kimi_eagle_host.pipeline.<step>); no module imports a step."""
