"""Images in prompts: loading them from what a request names (`media`), turning them into pixels
and placeholder tokens for a model (`processor`), and the per-prompt limits (`limits`)."""
