"""RULER-style NIAH generator and harness, with a small BPE tokenizer trained here on the essay."""
from __future__ import annotations

import json
import shutil
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from jax_offload.eval import niah, ruler
from jax_offload.eval.ruler import TASKS, make_samples, score_string_match_all

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# (answers, needles holding a queried key) per task, from RULER's synthetic.yaml.
EXPECTED_COUNTS = {
    "niah_single_1": (1, 1), "niah_single_2": (1, 1), "niah_single_3": (1, 1), "niah_multikey_1": (1, 1),
    "niah_multikey_2": (1, 1), "niah_multikey_3": (1, 1), "niah_multivalue": (4, 4), "niah_multiquery": (4, 4),
}
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (\S+) is: (\S+)\.")


def _train_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    text = (ruler.DATA_DIR / "persuasion.txt").read_text()[:60_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([text, ruler.TEMPLATE, "0123456789 abcdef-"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return _train_tokenizer(CHATML)


def _context(sample: ruler.NiahSample) -> str:
    return sample.prompt_text.split("afterwards.\n", 1)[1].split("\nWhat are all the special magic", 1)[0]


@pytest.mark.parametrize("task", TASKS)
def test_every_task_fits_the_target_and_holds_its_needles(tokenizer, task):
    target = 1024
    n_answers, n_query_needles = EXPECTED_COUNTS[task]
    cfg = ruler.TASK_CONFIGS[task]
    for s in make_samples(task, tokenizer, target, num_samples=3, seed=1, chat_template=True):
        assert s.task == task
        assert s.length == len(s.prompt_ids) <= target
        assert s.length >= 0.97 * target
        assert s.prompt_ids == tokenizer(s.prompt_text, add_special_tokens=False)["input_ids"]
        assert s.prompt_text.startswith("<|im_start|>user\nSome special magic")
        assert len(s.answers) == len(s.depths) == n_answers
        question = s.prompt_text.split("\nWhat are all the special magic ", 1)[1]
        needles = NEEDLE_RE.findall(_context(s))
        holding = [(k, v) for typ, k, v in needles if f" {k} " in question or f" {k}," in question]
        assert sorted(v for _, v in holding) == sorted(s.answers)
        assert len(holding) == n_query_needles  # distractors never reuse a queried key
        assert all(typ == cfg.value_type for typ, _, _ in needles)
        for answer in s.answers:
            assert re.fullmatch(r"\d{7}" if cfg.value_type == "numbers" else r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", answer)
        query = question.split(" mentioned in the provided text?", 1)[0].split(" for ", 1)[1]
        prefix = f" The special magic {cfg.value_type} for {query} mentioned in the provided text are"
        assert s.prompt_text.endswith("<|im_start|>assistant\n" + prefix)


def test_same_seed_gives_the_same_samples_and_another_seed_does_not(tokenizer):
    a = make_samples("niah_multikey_2", tokenizer, 512, 2, seed=3)
    b = make_samples("niah_multikey_2", tokenizer, 512, 2, seed=3)
    c = make_samples("niah_multikey_2", tokenizer, 512, 2, seed=4)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.answers for s in a] != [s.answers for s in c]


def test_keys_and_values_do_not_depend_on_the_length(tokenizer):
    short = make_samples("niah_multiquery", tokenizer, 512, 2, seed=5)
    long = make_samples("niah_multiquery", tokenizer, 1536, 2, seed=5)
    assert [s.answers for s in short] == [s.answers for s in long]


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
def test_single_needle_depths_spread_evenly_across_samples(tokenizer, task):
    samples = make_samples(task, tokenizer, 2048, 5, seed=0)
    # Needles snap to unit boundaries; some of the essay's sentences run past 100 words.
    assert [s.depths[0] for s in samples] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0], abs=0.1)
    for s in samples:
        # The needle's place, in haystack words, is the depth the sample reports.
        needle = next(m.group(0) for m in NEEDLE_RE.finditer(_context(s)) if m.group(3) == s.answers[0])
        before, _, after = _context(s).partition(needle)
        words_before, words_after = len(before.split()), len(after.split())
        assert words_before / (words_before + words_after) == pytest.approx(s.depths[0], abs=1e-9)


def test_essay_needles_sit_at_sentence_boundaries(tokenizer):
    for s in make_samples("niah_multikey_1", tokenizer, 2048, 3, seed=2):
        context = _context(s)
        for match in NEEDLE_RE.finditer(context):
            before = context[: match.start()].rstrip()
            at_end = NEEDLE_RE.sub("", context[match.end():]).strip() == ""  # after the cut-short last sentence
            assert before == "" or before[-1] in ".!?\"')" or at_end


def test_repeat_haystack_is_whole_sentences(tokenizer):
    for s in make_samples("niah_single_1", tokenizer, 1024, 3, seed=4):
        lines = _context(s).split("\n")
        assert all(NEEDLE_RE.fullmatch(line) or (ruler.REPEAT_BLOCK + " ").startswith(line + " ") for line in lines)


def test_multiple_needles_spread_inside_one_sample(tokenizer):
    for s in make_samples("niah_multivalue", tokenizer, 2048, 3, seed=0):
        depths = sorted(s.depths)
        gaps = [b - a for a, b in zip(depths, depths[1:])]
        assert gaps == pytest.approx([0.25] * 3, abs=0.08)


def test_bare_prompt_by_default(tokenizer):
    s = make_samples("niah_single_3", tokenizer, 768, 1, seed=0)[0]
    assert s.prompt_text.startswith("Some special magic uuids are hidden within the following text.")
    assert "<|im_start|>" not in s.prompt_text
    assert s.length <= 768
    assert re.search(r"the provided text\? The special magic uuids for \S+ mentioned in the provided text are$", s.prompt_text)


def test_chat_template_asked_of_a_tokenizer_without_one():
    with pytest.raises(ValueError, match="no chat template"):
        make_samples("niah_single_1", _train_tokenizer(None), 512, 1, seed=0, chat_template=True)


def test_unknown_task_is_named_with_the_valid_ones(tokenizer):
    with pytest.raises(ValueError, match="niah_single_9.*niah_single_1.*niah_multiquery"):
        make_samples("niah_single_9", tokenizer, 512, 1, seed=0)


def test_target_shorter_than_the_bare_prompt(tokenizer):
    with pytest.raises(ValueError, match="target_len 20 is too short for niah_single_2"):
        make_samples("niah_single_2", tokenizer, 20, 1, seed=0)


def test_string_match_all_scoring():
    outputs = ["The number is 1234567.", "nothing here", "111 and 222", "uuid ABC-def"]
    answers = [["1234567"], ["7654321"], ["111", "222", "333"], ["abc-DEF"]]
    assert score_string_match_all(outputs, answers) == pytest.approx(100 * (1 + 0 + 2 / 3 + 1) / 4)
    assert score_string_match_all(["a"], [["b"]]) == 0.0
    with pytest.raises(ValueError, match="2 outputs for 1 answer lists"):
        score_string_match_all(["a", "b"], [["a"]])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_run_niah_with_the_torch_backend(tiny_model_dir):
    result = niah.run_niah("torch", tiny_model_dir, ["niah_single_1", "niah_multivalue"], [512], 2, 0, 4, {})
    assert set(result["scores"]) == {"niah_single_1", "niah_multivalue"}
    assert all(0.0 <= v <= 100.0 for cell in result["scores"].values() for v in cell.values())
    assert result["config"]["backend"] == "torch" and result["config"]["lengths"] == [512]
    records = result["records"]
    assert [(r["task"], r["index"]) for r in records] == [("niah_single_1", 0), ("niah_single_1", 1), ("niah_multivalue", 0), ("niah_multivalue", 1)]
    assert all(r["prompt_tokens"] <= 512 and len(r["output_token_ids"]) <= 4 and isinstance(r["output"], str) for r in records)
    json.dumps(result)


def test_both_backends_leave_the_stop_token_out_of_the_output_ids(tiny_model_dir, tmp_path):
    free_run = niah.run_niah("torch", tiny_model_dir, ["niah_single_1"], [300], 1, 0, 4, {})
    generated = free_run["records"][0]["output_token_ids"]
    stop = generated[1]
    model_dir = tmp_path / "stops"
    shutil.copytree(tiny_model_dir, model_dir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = stop
        (model_dir / name).write_text(json.dumps(cfg))
    outputs = [
        niah.run_niah(backend, model_dir, ["niah_single_1"], [300], 1, 0, 4, opts)["records"][0]["output_token_ids"]
        for backend, opts in (("torch", {}), ("jax", {"dtype": "float32"}))
    ]
    assert outputs[0] == outputs[1] == generated[: generated.index(stop)]


def test_torch_backend_rejects_jax_only_options(tiny_model_dir):
    with pytest.raises(ValueError, match="block_size"):
        niah.run_niah("torch", tiny_model_dir, ["niah_single_1"], [300], 1, 0, 2, {"block_size": 64})


def test_cli_writes_json_and_prints_the_table(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = niah.main(["--model", str(tiny_model_dir), "--backend", "torch", "--tasks", "niah_single_2", "--lengths", "256,320",
                    "--samples", "1", "--max-tokens", "2", "--chat-template", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| task | 256 | 320 |" in table and "| niah_single_2 |" in table
    saved = json.loads(out.read_text())
    assert set(saved["scores"]["niah_single_2"]) == {"256", "320"} and len(saved["records"]) == 2
    assert saved["config"]["chat_template"] is True


def test_cli_rejects_an_unknown_task(capsys):
    with pytest.raises(SystemExit) as exit_info:
        niah.main(["--tasks", "niah_single_1,bogus"])
    assert exit_info.value.code == 2
    assert "bogus" in capsys.readouterr().err
