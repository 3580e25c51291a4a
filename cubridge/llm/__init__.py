"""LLM proposers for what the rules cannot express, and their prompts.

Importing this package registers the proposer kinds "vllm" (vllm.LLM from a local model directory,
in process or in a Ray actor) and "openai" (an OpenAI-compatible endpoint such as `vllm serve`,
reached with the standard library). Neither vllm nor ray is imported until a backend that needs
it is built.

Three tasks share one sampling-and-repair loop (`engine.Sampler`):
- transfer (`proposer.LLMProposer`, ask / tell): reference CuIR + spec -> target CuIR;
- lift (`lift.lift`): a CUDA attention kernel -> CuIR + lifting map, accepted by an injected GPU check;
- lower (`lower.lower`): a CuIR change -> a patch of the kernel's marked regions, accepted by an
  injected compile + GPU check.

Model output is untrusted: CuIR goes through the whitelist parser and is interpreted, never
executed; CUDA is only handed to the acceptance callables (the tuner's isolated runner workers);
everything the model said and why each candidate was rejected is logged as JSON lines.
"""
from cubridge.llm.proposer import LLMProposer, make_backend  # noqa: F401  (registers "vllm", "openai")
