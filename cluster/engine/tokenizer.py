"""The model folder's tokenizer and chat template, through transformers.

A folder whose tokenizer_config.json names the generic fast tokenizer (`TokenizersBackend`, or
`PreTrainedTokenizerFast`, its old name), as the default model's does, loads it without
AutoTokenizer: AutoTokenizer's import chain loads torch (~2 s of CPU, ~0.2 GB), which a router
replica, holding no engine, has no use for. Any other class goes through AutoTokenizer.

An engine only turns ids into text (and needs the end-of-text ids): `Tokenizer(path, lazy=True)`
does that with the `tokenizers` library alone where the folder's tokenizer.json is all there is
to it (the generic class, every special token its config names already special there, no
clean-up of spaces), and loads transformers (~1.6 s of CPU a process on a slow host) only when
something asks for more: a chat template, `encode`, a grammar (xgrammar imports it anyway).
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")

# What a request's template variables may never set: the render's own arguments, what
# transformers puts in every template's scope, and the model's special tokens.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "raise_exception", "strftime_now", "namespace", "dict",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens"})


class Tokenizer:
    def __init__(self, model_path: str | Path, lazy: bool = False) -> None:
        """`lazy`: transformers loads on first need (see the module's docstring), not now."""
        self.folder = Path(model_path)
        settings = self.folder / "tokenizer_config.json"
        self._settings = json.loads(settings.read_text()) if settings.is_file() else {}
        self._fast = _fast_tokenizer(self.folder, self._settings) if lazy else None
        self.eos_token_ids = frozenset(self._eos_ids(self.folder))

    @cached_property
    def hf(self) -> Any:
        """The transformers tokenizer (loaded on first use where `lazy`)."""
        return _load(self.folder)

    def _eos_ids(self, folder: Path) -> set[int]:
        ids: set[int] = set()
        if self._fast is not None:
            eos = _content(self._settings.get("eos_token"))
            eos_id = self._fast.token_to_id(eos) if eos is not None else None
        else:
            eos_id = self.hf.eos_token_id
        if eos_id is not None:
            ids.add(int(eos_id))
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """transformers' decode (`clean_up_tokenization_spaces`: None is the folder's setting, or
        where it has none transformers' own default)."""
        clean_up = (self._settings.get("clean_up_tokenization_spaces") if clean_up_tokenization_spaces is None
                    else clean_up_tokenization_spaces)
        if self._fast is not None and clean_up is False:  # what transformers' decode does then, itself
            return self._fast.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=clean_up_tokenization_spaces)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The template's text; `continue_final_message`: ending inside the last message, for
        the model to go on with it (instead of a new assistant turn). `template_kwargs`: extra
        variables (vLLM's chat_template_kwargs, e.g. `enable_thinking`); only those the template
        reads are passed, never a reserved one."""
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        extra = {}
        if template_kwargs:  # (most requests pass none: the template is not scanned for them)
            reads = self.template_variables - RESERVED_TEMPLATE_VARIABLES
            extra = {k: v for k, v in template_kwargs.items() if k in reads}
        return self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           tokenize=False, tools=list(tools) if tools else None, **extra)

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The chat template already writes the special tokens, so none are added on top."""
        text = self.chat_prompt(messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
        return list(self.hf.encode(text, add_special_tokens=False))

    @property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from outside itself."""
        return _template_variables(self.hf.chat_template or "")

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template writes `tools` itself (else router/tools.py describes them)."""
        return "tools" in (self.hf.chat_template or "")

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True) if self._fast is not None else len(self.hf)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _fast_tokenizer(folder: Path, settings: dict[str, Any]) -> Any:
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, where transformers would decode
    with it unchanged: the generic class, and every special token the config names (and every
    token it adds) already in tokenizer.json, special alike. None otherwise."""
    path = folder / "tokenizer.json"
    if settings.get("tokenizer_class") not in GENERIC_TOKENIZERS or not path.is_file():
        return None
    from tokenizers import Tokenizer as FastTokenizer

    fast = FastTokenizer.from_file(str(path))
    added = {t.content: t.special for t in fast.get_added_tokens_decoder().values()}
    named = [_content(settings.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                                                  "cls_token", "mask_token")]
    extra = settings.get("additional_special_tokens") or settings.get("extra_special_tokens") or []
    named += [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    if any(t is not None and added.get(t) is not True for t in named):
        return None
    for token in (settings.get("added_tokens_decoder") or {}).values():
        if added.get(token.get("content")) != token.get("special", False):
            return None
    return fast


def _load(folder: Path) -> Any:
    settings = folder / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
    if named in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer, PreTrainedConfig

    # AutoTokenizer reads config.json only for its model_type (and tokenizer_class). Left to
    # itself it builds the model's own config class, whose import chain costs ~2 s of CPU more;
    # the plain config object carries the same fields.
    config = PreTrainedConfig.from_dict(json.loads((folder / "config.json").read_text()))
    config._name_or_path = str(folder)
    return AutoTokenizer.from_pretrained(str(folder), config=config)


@lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment

    env = _compile_jinja_template(template).environment  # its extensions parse its tags ({% generation %})
    return frozenset(meta.find_undeclared_variables(env.parse(template)))
