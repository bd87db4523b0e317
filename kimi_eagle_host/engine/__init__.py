"""The vLLM pieces: extraction through vLLM and our KV connector (loaded by vLLM's workers by module name)."""
