"""What eval uses: the transformers speculative engine and the report chart."""
