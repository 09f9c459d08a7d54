"""`oscar-serve` (transformers serve with the 2-bit pool) on localhost, talked to with the OpenAI client: streamed chat
completions from several concurrent clients, a request longer than the pool refused with HTTP 400 naming the limit,
the server serving afterwards; and its command line. The server runs a tiny random Llama with a character-level
tokenizer, on the CPU; its model runs in a process of its own, which the pool's refusal shows it reached."""

import json
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from oscar_hf.serving.serve import split_arguments

TOKENS = 12


def _tiny_model(folder) -> None:
    """A tiny random Llama and a character-level tokenizer with a chat template, saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    characters = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *characters])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    bpe.decoder = decoders.Fuse()
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", chat_template=template
    ).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=16384,  # past the pool: its limit, not the model's, refuses the long request
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, model) of an `oscar-serve` process, stopped (by its pid) after the module's tests."""
    folder = tmp_path_factory.mktemp("served")
    model = folder / "model"
    _tiny_model(model)
    port, log = _free_port(), folder / "server.log"
    command = [
        *(sys.executable, "-P", "-m", "oscar_hf.serving.serve", str(model)),
        *("--continuous-batching", "--device", "cpu", "--port", str(port), "--cb-num-blocks", "40"),
        *("--cache-config", '{"bits": 2, "sink_tokens": 4}'),
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=folder)
    url = f"http://localhost:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"the server stopped:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield f"{url}/v1", str(model)
    finally:
        process.terminate()  # its model process follows its parent out
        process.wait(30)


@pytest.mark.slow
def test_concurrent_streams_a_refused_long_request_and_serving_afterwards(server):
    import openai

    url, model = server
    client = openai.OpenAI(base_url=url, api_key="none")

    def stream(prompt: str) -> tuple[str, str | None]:
        chunks, finish = [], None
        messages = [{"role": "user", "content": prompt}]
        for chunk in client.chat.completions.create(
            model=model, messages=messages, stream=True, max_tokens=TOKENS, temperature=0
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return "".join(chunks), finish

    answers = {}
    prompts = ["hello", "a longer question " * 20, "x" * 300, "short"]  # past a 128-token page and below it
    threads = [threading.Thread(target=lambda p=p: answers.setdefault(p, stream(p))) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert set(answers) == set(prompts)
    for text, finish in answers.values():
        assert text and finish in ("length", "stop")
    assert answers["hello"] == stream("hello")  # greedy: the same answer alone as among others

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "y" * 6000}], max_tokens=8)
    assert refused.value.status_code == 400
    assert (
        "more than the 2-bit pool holds for one request" in refused.value.body["detail"]
    )  # the model's process has it

    text, finish = stream("still there?")
    assert text and finish


def test_cache_config_option():
    assert split_arguments(["m", "--cache-config", '{"bits": 4}', "--port", "1"]) == ({"bits": 4}, ["m", "--port", "1"])
    assert split_arguments(["--cache-config={}", "m"]) == ({}, ["m"])
    assert split_arguments(["m"]) == ({}, ["m"])
    for bad, message in (
        ('{"bits": "auto"}', "bits=2"),
        ("[2]", "JSON object"),
        ("{bits}", "is not JSON"),
        (json.dumps({"colour": 1}), "Unknown OscarCache option"),
    ):
        with pytest.raises(SystemExit, match=message):
            split_arguments(["m", "--cache-config", bad])
