"""LLM proposers (vLLM in-process, OpenAI-compatible endpoint) and their prompts. Not built yet:
the rules path comes first; see the project's issues."""
