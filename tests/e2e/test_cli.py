"""`tandem` as a user runs it: a subprocess, real model, output on the terminal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_chat_streams_the_default_models_answer(default_model_path):
    proc = tandem("chat", "What is the capital of France?", "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_with_a_local_folder_and_a_missing_one(tiny_model_paths, tmp_path):
    proc = tandem("chat", "Hi", "--model", str(tiny_model_paths["qwen2"]), "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("{")  # JSON mode, even from a random model
    missing = tandem("chat", "Hi", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "tandem: error" in missing.stderr and "nope" in missing.stderr


def test_chat_with_a_json_schema_file_and_a_schema_it_cannot_enforce(tiny_model_paths, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    (tmp_path / "shape.json").write_text(json.dumps(schema))
    proc = tandem("chat", "Hi", "--model", str(tiny_model_paths["qwen2"]), "--max-tokens", "60",
                  "--json-schema", str(tmp_path / "shape.json"))
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), schema)  # the whole answer is a value of the schema

    (tmp_path / "unique.json").write_text(json.dumps({"type": "object", "properties": {"s": {"uniqueItems": True}}}))
    refused = tandem("chat", "Hi", "--json-schema", str(tmp_path / "unique.json"))
    assert refused.returncode == 2 and "'uniqueItems' is not supported" in refused.stderr
    both = tandem("chat", "Hi", "--json", "--json-schema", str(tmp_path / "shape.json"))
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_chat_with_an_ebnf_grammar_file_and_one_that_does_not_compile(tiny_model_paths, tmp_path):
    import re

    (tmp_path / "answer.ebnf").write_text('root ::= ("yes" | "no") " because " [a-z]{1,8}\n')
    proc = tandem("chat", "Hi", "--model", str(tiny_model_paths["qwen2"]), "--max-tokens", "20",
                  "--grammar", str(tmp_path / "answer.ebnf"))
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"(yes|no) because [a-z]{1,8}", proc.stdout.rstrip("\n")), proc.stdout
    (tmp_path / "broken.ebnf").write_text("root ::= undefined_rule\n")
    broken = tandem("chat", "Hi", "--model", str(tiny_model_paths["qwen2"]), "--grammar", str(tmp_path / "broken.ebnf"))
    assert broken.returncode == 2 and "tandem: error: the grammar does not compile" in broken.stderr


def test_convert_model_reuses_the_cached_folder(default_model_path):
    weights = default_model_path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    proc = tandem("convert-model", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(default_model_path)
    assert weights.stat().st_mtime_ns == before
