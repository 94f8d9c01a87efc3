"""asyncrl's serving front: the embedded engine behind sglang's, vLLM's and the OpenAI HTTP
APIs (``python -m asyncrl.serving.serve``), each answering as one release of the real
server. The remote engine's clients (``asyncrl.engine``) run against it on machines
without a GPU, and multi-turn agents (``asyncrl.episodes.openai_agent``) talk to it as to
any OpenAI-compatible server. It is a product of its own beside the engine clients: it
imports the engine, the engine never imports it.

- ``serve``: the aiohttp application and the entry point; ``serve_engine``: the engine and
  the task that steps it; ``serve_protocol``: ``/generate`` bodies and responses.
- ``sglang_routes``: sglang's other routes; ``vllm_api``: vLLM's RL routes;
  ``vllm_transfer``: vLLM's weight transfer over gloo.
- ``openai_protocol`` parses and shapes OpenAI requests; ``openai_api`` serves them.
"""
