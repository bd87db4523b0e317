"""The target model: loading it under transformers, its decoder stack and layer ids, the tiny Kimi-K2.5 layout."""
