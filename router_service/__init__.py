"""The router: client API, tokenizer, scheduler, KV cache, attention, gating, dispatch/combine, sampling."""
