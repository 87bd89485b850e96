"""A checkpoint with a tokenizer and a chat template, saved by transformers as a published model would be:
the byte-level tokenizer plus <s> and </s> (ids 256, 257), <s> put before a text prompt, and a template that
uses bos_token, eos_token, loop variables, a filter and raise_exception."""

from __future__ import annotations

from pathlib import Path

from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from tests.models import Oracle, build_model, save_checkpoint, small_config
from tests.tokenizer_fixtures import byte_level_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'system' and not loop.first %}"
            "{{ raise_exception('the system message must come first') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB = 258


def hf_tokenizer(template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    """As Llama's and Mixtral's: a post-processor puts <s> before a text's ids (`tokenizer(text)`); a chat
    template writes its own."""
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), bos_token="<s>", eos_token="</s>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    if template is not None:
        tok.chat_template = template
    return tok


def chat_checkpoint(path: Path, template: str | None = TEMPLATE,
                    seed: int = 3) -> tuple[Oracle, PreTrainedTokenizerFast]:
    """OLMoE (vocab 258, no EOS in its config) with that tokenizer saved beside it."""
    model = build_model(small_config("olmoe", vocab_size=VOCAB), seed=seed)
    save_checkpoint(model, path)
    tok = hf_tokenizer(template)
    tok.save_pretrained(path)
    return Oracle(model, path), tok
