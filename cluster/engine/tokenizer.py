"""The model folder's tokenizer and chat template, through transformers.

A folder whose tokenizer_config.json names the generic fast tokenizer (`TokenizersBackend`, or
`PreTrainedTokenizerFast`, its old name), as the default model's does, loads it without
AutoTokenizer: AutoTokenizer's import chain loads torch (~2 s of CPU, ~0.2 GB), which a router
replica, holding no engine, has no use for. Any other class goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from functools import lru_cache
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
    def __init__(self, model_path: str | Path) -> None:
        self.hf = _load(Path(model_path))
        self.eos_token_ids = frozenset(self._eos_ids(Path(model_path)))

    def _eos_ids(self, folder: Path) -> set[int]:
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

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
        return len(self.hf)


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
