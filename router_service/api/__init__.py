"""The client API of the router: the `colibri.v1.Generation` gRPC service (`server.py`), the `colibri router`
process that serves it with the Admin service (`main.py`), its options
(`options.py`), the composition root that assembles tokenizer, engine, model and MoE client (`build.py`), stalled
client detection (`stalls.py`), incremental detokenisation with stop strings (`text_output.py`), and a request's
choices as their clients see them, text and all (`choices.py`, shared with the offline `colibri.LLM`).

May import `engine`, `model` and `moe`; nothing below imports it.
"""
