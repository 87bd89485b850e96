"""A checkpoint's chat template: found as transformers saves it, rendered as transformers renders it.

The router reads the template (`load_chat_template`) and hands it out in ModelInfo; the OpenAI front renders
it (`ChatTemplate.render`). Templates from a model hub are untrusted code, so they run in jinja2's
`ImmutableSandboxedEnvironment` with transformers' settings (trim_blocks, lstrip_blocks, loopcontrols) and its
helpers (`raise_exception`, a `tojson` that does not escape HTML, `strftime_now`), and the special tokens of
`tokenizer_config.json` (bos_token, eos_token, ...) as variables, so the text equals
`tokenizer.apply_chat_template(messages, tokenize=False, ...)`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from colibri_common.errors import CheckpointError

TEMPLATE_FILE = "chat_template.jinja"           # transformers >= 4.50 saves a single template here
CONFIG_FILE = "tokenizer_config.json"           # ... older checkpoints keep it under "chat_template"
SPECIAL_FILE = "special_tokens_map.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused the messages (its raise_exception) or failed to render: the client's 400."""


class TemplateBroken(ValueError):
    """The template does not compile: the checkpoint's fault, whatever the messages (a 500 that says so)."""


def compile_error(source: str) -> str | None:
    """Why the template does not compile (jinja2's syntax error, with its line), or None: for `validate`, so that a
    broken template is named as the checkpoint's, not as any request's."""
    return ChatTemplate(source).broken()


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):   # a serialised AddedToken
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def load_chat_template(model_dir: str | Path) -> tuple[str | None, dict[str, str]]:
    """(the default chat template or None, the special tokens the template sees) of a checkpoint."""
    root = Path(model_dir)
    config = _read_json(root / CONFIG_FILE) if (root / CONFIG_FILE).is_file() else {}
    special: dict[str, str] = {}
    sources = [_read_json(root / SPECIAL_FILE)] if (root / SPECIAL_FILE).is_file() else []
    for source in [*sources, config]:
        for name in SPECIAL_NAMES:
            text = _token_text(source.get(name))
            if text is not None:
                special[name] = text
    template: str | None = None
    if (root / TEMPLATE_FILE).is_file():
        try:
            template = (root / TEMPLATE_FILE).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{root / TEMPLATE_FILE}: not UTF-8 text ({exc}); save it as UTF-8") from None
    else:
        raw = config.get("chat_template")
        if isinstance(raw, str):
            template = raw
        elif isinstance(raw, list):       # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            template = named.get("default") if isinstance(named.get("default"), str) else None
    return template, special


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    _compiled: Any = field(default=None, compare=False, repr=False)
    _broken: str | None = field(default=None, compare=False, repr=False)

    def broken(self) -> str | None:
        """Why the template does not compile, or None; compiled once (the front asks at its start, then each
        render)."""
        import jinja2

        if self._compiled is not None or self._broken is not None:
            return self._broken
        try:
            self._compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            self._broken = f"{exc.message} (line {exc.lineno})"
        except jinja2.TemplateError as exc:
            self._broken = str(exc)
        except Exception as exc:  # noqa: BLE001 (Python's own refusals of the compiled code: blocks nested too deep)
            self._broken = f"{type(exc).__name__}: {exc}"
        return self._broken

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages`, with `extra` (a request's chat_template_kwargs) among the template's
        variables; TemplateError when the template refuses them."""
        import jinja2

        if (why := self.broken()) is not None:
            raise TemplateBroken(f"the model's chat template does not compile: {why}. That is a fault of the "
                                 f"checkpoint, not of the request: fix its chat_template.jinja (or "
                                 f"tokenizer_config.json's chat_template), or use /v1/completions")
        try:
            # one dict, not keywords: a variable may be named as render's own parameters ('self')
            return self._compiled.render({**self.special_tokens, **(extra or {}), "messages": messages, "tools": None,
                                          "documents": None, "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template refused the messages: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 (a template is code: any error in it is about these messages)
            raise TemplateError(f"the model's chat template failed on the messages: {exc!r}") from exc


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    helpers: dict[str, Callable[..., Any]] = {"raise_exception": raise_exception, "strftime_now": strftime_now}
    env.globals.update(helpers)
    return env
