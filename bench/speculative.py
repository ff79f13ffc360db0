"""Speculative decoding: batch-1 decode speed with it on vs off.

Engines in this process on the same target model: one without
speculation, one with --speculative-algorithm NGRAM, one with STANDALONE.
Each row compares one of them with the plain engine on one workload:

- greedy, for NGRAM and STANDALONE, two copy-heavy workloads (most of
  the answer is in the prompt): rewrite a ~220-token text with a town's
  name changed (copy), and give back a ~300-token text with its
  misspelling fixed (edit); the embedded model paraphrases the first and
  copies the second. And free chat (nothing to copy; the drafter must
  switch itself off);
- the copy-heavy workload as JSON under a schema, for NGRAM: both engines
  jump forward over the keys, the speculative one drafts the text too;
- with --eagle3-head DIR (an EAGLE-3 head trained for the target, as
  SGLang loads it; none is on this machine), copy-heavy and free chat
  with EAGLE3;
- the copy-heavy workload sampled at temperature 0.7, and free chat at 0.7
  and 1.0 (seeded per round, the same seed on both sides), for NGRAM:
  sampled drafts go through rejection sampling, so the text differs from
  the plain engine's but follows the same distribution.

- NGRAM trees (--speculative-ngram-max-bfs-breadth --bfs-breadth, 4),
  drafted from every request's tokens: the copy workload and free chat,
  each round the same prompt again, as a client retrying or regenerating
  sends it. The trie holds what the warm-up and the earlier rounds
  answered: greedy, the whole answer; sampled (free chat at 1.0), earlier
  draws of it.

`--corpus` runs NGRAM trees with a corpus (--speculative-ngram-external-
corpus-path, --sam-budget nodes reserved, 3) instead: the corpus holds the
plain engine's greedy answers to five chat questions, as an operator
would load last week's answers, and each round asks one of them for the
first time (the first question warms up), so the drafts come from the
corpus and not from the trie; beside it, the same trees without the
corpus on the same questions. And what a corpus costs: one of this
repository's sources and docs, built (its build rate, the bytes it holds
per token, the peak memory its build adds per token), and the time of a
draft of 8 from it after 12 tokens of its documents.

No draft model smaller than the embedded SmolLM2-135M with its tokenizer
is on this machine, so the STANDALONE draft is built by the script from
the target's own checkpoint: its first --draft-layers decoder layers, its
final norm and (tied) output embedding, saved as a checkpoint of its own.
That is a real draft model of the target's tokenizer, a third of its
layers, untrained as a stand-alone model: what it measures is the
machinery's cost against what an early-exit draft of this model gets
accepted, not what a trained draft of a larger target would give. A last
row drafts with the target's own checkpoint (every draft kept, each draft
token as dear as a target step): the bound of what acceptance alone buys.

Rounds alternate off, on, on, off (ABBA) and each figure is the median
over rounds of decode tokens per second (after the first token), so the
ratio holds on a noisy machine. Greedy engines give the plain engine's
tokens, in float32 and in the 4-bit mode; the script reports how many
leading tokens agree. With --concurrency N each round sends N copies of
the request at once (sampled ones seeded apart), and the figure is the
batch's output tokens per second over its wall time: where drafts that
pay alone stop paying among many rows. The copies' prompts are then
computed in chunks that the scheduler cuts where the token budget ends,
so in the 4-bit mode a copy's greedy text can differ from the same
request alone, on both sides (docs/cpu-kernels.md).

`--step-costs` times single forward steps instead, on the model alone
(no engine): a decode step (--rows rows, default one, one token each) and
that step with k drafts in its first row (k + 1 tokens, logits at each),
after a 278-token prompt, alternated; each verify step's cost as a
multiple of the decode step's, and the plan (step_plan.py) each step
gets; and what a draft adds to the step as a share of a one-row decode
step (with several rows, one is timed too): the draft cost the CPU's
drafting rule assumes (speculative/drafter.py).

`--head-cost` times one step of an EAGLE head (one decoder layer shaped
as the target's, random weights: a step costs the same trained or not)
for one row after a 278-token prompt: with the target's whole vocabulary
projection, and cut by token maps (--speculative-token-map) of 32768 and
8192 tokens (the lowest ids, as a byte-level BPE ranks its most frequent
merges first; the cost depends on the count alone), alternated with the
target's own one-row decode step, the unit each is counted in.

    python bench/speculative.py                 # embedded model, CPU
    python bench/speculative.py --rounds 6 --max-tokens 300
    python bench/speculative.py --concurrency 16 --only ngram_copy ngram_copy_t0.7
    python bench/speculative.py --step-costs    # one verify step against one decode step
    python bench/speculative.py --step-costs --rows 16   # what a draft adds to a 16-row step
    python bench/speculative.py --head-cost     # an EAGLE head's draft step, with and without token maps
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

TEXT = (
    "The harbour town of Kelmsford wakes early. Before dawn the fishing boats slip out past the breakwater, "
    "their lamps swinging in the swell, and by six the market hall is full of crates of mackerel, crab and "
    "hake. The baker on Quay Street opens at half past six; her rye loaves sell out by eight. Children walk "
    "to the school on the hill, where the bell in the old tower still rings the hours, although it has "
    "been a minute slow since the storm of last winter. In the afternoon the tide goes out and leaves the "
    "mud flats shining, and the wading birds arrive in their hundreds: curlews, redshanks and the odd "
    "heron standing perfectly still. Visitors come for the lighthouse, which is open on weekends from "
    "April to October, and for the museum, whose collection of ship models fills three rooms. In the "
    "evening the pubs along the harbour wall fill with people, the boats come back with the light fading, "
    "and the gulls fight over what the fishermen throw away. On Sundays the town is quiet, and the only "
    "sound is the bell."
)
COPY = f"Rewrite the following text exactly, but change the town's name from Kelmsford to Ashby.\n\n{TEXT}"
# A copy editor's request: the text with one more paragraph (296 tokens)
# and one misspelling to fix. The embedded model answers it by copying the
# text, where it paraphrases the rename above.
EDIT_TEXT = (TEXT + " On Monday the boats go out again, the baker lights her ovens before five, and the children "
             "climb the hill to the school. In spring the council repaints the railings along the quay, and in "
             "summer the harbour hosts a regatta, when yachts from the whole coast crowd the water and the town's "
             "population doubles for a week.").replace("breakwater", "breakwatter")
EDIT = f"Fix the spelling mistake in this text and give back the whole corrected text.\n\n{EDIT_TEXT}"
# The copy as structured output: the grammar forces the keys and quotes (jump-forward on both sides).
JSON_COPY = ("Answer in JSON with the town's new name and the rewritten text. " + COPY)
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"town": {"type": "string", "maxLength": 40},
                                                             "text": {"type": "string", "maxLength": 3000}},
                          "required": ["town", "text"]})
CHAT = "Write a short story about a robot who learns to paint."
# (row name, prompt, engine compared with "off", temperature[, JSON schema])
ROWS = [
    ("ngram_copy", COPY, "ngram", 0.0),
    ("ngram_edit", EDIT, "ngram", 0.0),
    ("ngram_json_copy", JSON_COPY, "ngram", 0.0, JSON_SCHEMA),
    ("ngram_chat", CHAT, "ngram", 0.0),
    ("ngram_copy_t0.7", COPY, "ngram", 0.7),
    ("ngram_chat_t0.7", CHAT, "ngram", 0.7),
    ("ngram_chat_t1.0", CHAT, "ngram", 1.0),
    ("standalone_copy", COPY, "standalone", 0.0),
    ("standalone_edit", EDIT, "standalone", 0.0),
    ("standalone_chat", CHAT, "standalone", 0.0),
    ("standalone_self_copy", COPY, "standalone_self", 0.0),
    ("ngram_trees_copy", COPY, "ngram_trees", 0.0),
    ("ngram_trees_chat", CHAT, "ngram_trees", 0.0),
    ("ngram_trees_chat_t1.0", CHAT, "ngram_trees", 1.0),
]
# --corpus: questions whose answers the corpus holds; each round asks one for the first time.
CORPUS_QUESTIONS = [CHAT, "Describe a day in the life of a lighthouse keeper.", "Explain how bees make honey.",
                    "Write a letter to a friend about a trip to the mountains.",
                    "Tell me the history of the bicycle in a few paragraphs."]
# With --eagle3-head: an EAGLE-3 head trained for the target (none is on this machine).
EAGLE3_ROWS = [("eagle3_copy", COPY, "eagle3", 0.0), ("eagle3_chat", CHAT, "eagle3", 0.0)]


def truncated_draft(model_dir: Path, out: Path, layers: int) -> Path:
    """The checkpoint's first `layers` decoder layers with its embeddings,
    final norm and head: a draft model with the target's tokenizer."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    # The weights, and the 4-bit codes the target ships (model.int4wo-32.safetensors), if any.
    for path in sorted(model_dir.glob("model*.safetensors")):
        tensors = {}
        with safe_open(path, "pt") as f:
            for key in f.keys():
                parts = key.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                    continue
                tensors[key] = f.get_tensor(key)
        save_file(tensors, out / path.name, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


async def decode_speed(engine, ids: list[int], max_tokens: int, temperature: float, seed: int,
                       schema: str | None = None) -> tuple[float, list[int]]:
    """(decode tokens per second after the first token, the tokens) of one request."""
    from pyserve.engine.request import Constraint, GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                            seed=seed if temperature else None,
                            constraint=Constraint("json_schema", schema) if schema else None)
    tokens, first = [], None
    async for out in engine.generate(GenerateRequest(ids, params)):
        tokens += out.token_ids
        if first is None and tokens:
            first, first_count = time.perf_counter(), len(tokens)
    return (len(tokens) - first_count) / (time.perf_counter() - first), tokens


async def batch_speed(engine, ids: list[int], copies: int, max_tokens: int, temperature: float, seed: int,
                      schema: str | None = None) -> tuple[float, list[int]]:
    """(output tokens per second of `copies` requests at once, over the
    batch's wall time, prompts included; the first request's tokens).
    Sampled copies are seeded apart."""
    start = time.perf_counter()
    runs = await asyncio.gather(*(decode_speed(engine, ids, max_tokens, temperature, seed * copies + i, schema)
                                  for i in range(copies)))
    return sum(len(tokens) for _, tokens in runs) / (time.perf_counter() - start), runs[0][1]


async def run(args, model_dir: Path, draft_dir: Path) -> dict:
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.server_args import ServerArgs

    common = dict(model_path=str(model_dir), device=args.device, max_total_tokens=16384, disable_radix_cache=True,
                  torchao_config=args.torchao_config,
                  disable_overlap_schedule={"auto": None, "on": False, "off": True}[args.overlap])
    engines = {"off": Engine.from_args(ServerArgs(**common)),
               "ngram": Engine.from_args(ServerArgs(**common, speculative_algorithm="NGRAM",
                                                    speculative_num_draft_tokens=args.draft_tokens,
                                                    speculative_ngram_min_match_window_size=args.min_window)),
               "standalone": Engine.from_args(ServerArgs(**common, speculative_algorithm="STANDALONE",
                                                         speculative_draft_model_path=str(draft_dir),
                                                         speculative_num_steps=args.draft_steps)),
               # Trees from every request's tokens: each round's request is the
               # same prompt again, so the trie holds the earlier rounds' answers.
               "ngram_trees": Engine.from_args(ServerArgs(**common, speculative_algorithm="NGRAM",
                                                          speculative_num_draft_tokens=args.draft_tokens,
                                                          speculative_ngram_min_match_window_size=args.min_window,
                                                          speculative_ngram_max_bfs_breadth=args.bfs_breadth)),
               # The target's own checkpoint as its draft: every draft kept, at
               # a draft cost of a whole target step; bounds what acceptance buys.
               "standalone_self": Engine.from_args(ServerArgs(**common, speculative_algorithm="STANDALONE",
                                                              speculative_draft_model_path=str(model_dir),
                                                              speculative_num_steps=args.draft_steps))}
    rows = ROWS
    if args.eagle3_head:
        engines["eagle3"] = Engine.from_args(ServerArgs(**common, speculative_algorithm="EAGLE3",
                                                        speculative_draft_model_path=args.eagle3_head,
                                                        speculative_num_steps=args.draft_steps))
        rows = ROWS + EAGLE3_ROWS
    for engine in engines.values():
        await engine.start()
    template = ChatTemplate.for_model(engines["off"].model_dir)

    def prompt(text: str) -> list[int]:
        return engines["off"].tokenizer.encode(template.render([{"role": "user", "content": text}],
                                                                add_generation_prompt=True))

    result = {}
    for name, text, side, temperature, *schema in rows:
        if args.only and name not in args.only:
            continue
        schema = schema[0] if schema else None
        ids = prompt(text)
        engine = engines[side]
        speeds = {"off": [], "on": []}
        outputs = {}
        await decode_speed(engine, ids, 8, temperature, 0, schema)  # warm-up
        await decode_speed(engines["off"], ids, 8, temperature, 0, schema)
        m = engine.metrics
        steps0, emitted0 = m.spec_verify_steps, m.spec_emitted_tokens
        for r in range(args.rounds):
            for which in (("off", "on") if r % 2 == 0 else ("on", "off")):
                side = engines["off"] if which == "off" else engine
                if args.concurrency == 1:
                    speed, tokens = await decode_speed(side, ids, args.max_tokens, temperature, r, schema)
                else:
                    speed, tokens = await batch_speed(side, ids, args.concurrency, args.max_tokens, temperature, r,
                                                      schema)
                speeds[which].append(speed)
                outputs[which] = tokens
        on, off = statistics.median(speeds["on"]), statistics.median(speeds["off"])
        row = {"prompt_tokens": len(ids), "output_tokens": len(outputs["on"]), "off_tok_s": round(off, 1),
               "on_tok_s": round(on, 1), "ratio": round(on / off, 2),
               "accept_len": round((m.spec_emitted_tokens - emitted0) / max(m.spec_verify_steps - steps0, 1), 2)}
        if temperature == 0:
            row["identical_leading_tokens"] = next(
                (i for i, (a, b) in enumerate(zip(outputs["on"], outputs["off"])) if a != b),
                min(len(outputs["on"]), len(outputs["off"])))
            if args.torchao_config == "none":
                assert outputs["on"] == outputs["off"], f"{name}: speculation changed the greedy output"
        result[name] = row
        print(name, json.dumps(row), flush=True)
    for engine in engines.values():
        await engine.shutdown()
    return result


def corpus_cost(model_dir: Path) -> dict:
    """--corpus, first (before any engine raises the peak memory): a corpus
    of this repository's sources and docs built, its build rate, the bytes
    it holds per token and the peak memory its build added per token."""
    import resource

    from pyserve._rust import NgramCorpus, Tokenizer

    root = Path(__file__).resolve().parent.parent
    files = sorted(f for pattern in ("docs/*.md", "pyserve/**/*.py", "rust/**/*.rs", "tests/*.py")
                   for f in root.glob(pattern))
    documents = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode_batch(
        [f.read_text() for f in files], False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    corpus = NgramCorpus(documents)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Drafts of 8 after 12-token stretches of the documents, from the corpus alone (an empty trie).
    import random

    from pyserve._rust import NgramTrie

    trie, rng = NgramTrie(18, 1000, 3, 12, 1, 4, False), random.Random(0)
    stretches = [d[i - 12:i] for d in rng.choices([d for d in documents if len(d) > 12], k=2000)
                 for i in [rng.randrange(12, len(d))]]
    start = time.perf_counter()
    for ids in stretches:
        trie.draft(ids, 8, [corpus], 3)
    row = {"documents": len(documents), "tokens": corpus.tokens,
           "build_m_tokens_s": round(corpus.tokens / seconds / 1e6, 2),
           "held_bytes_per_token": round(corpus.nbytes / corpus.tokens, 1),
           "build_peak_bytes_per_token": round((peak - before) / corpus.tokens),
           "draft_us": round((time.perf_counter() - start) / len(stretches) * 1e6, 1)}
    print("corpus_cost", json.dumps(row), flush=True)
    return row


async def corpus_run(args, model_dir: Path, tmp: Path) -> dict:
    """--corpus: see the module's docstring."""
    from pyserve.chat_template import ChatTemplate
    from pyserve.engine.engine import Engine
    from pyserve.server_args import ServerArgs

    common = dict(model_path=str(model_dir), device=args.device, max_total_tokens=16384, disable_radix_cache=True,
                  torchao_config=args.torchao_config)
    off = Engine.from_args(ServerArgs(**common))
    await off.start()
    template = ChatTemplate.for_model(off.model_dir)
    prompts = [off.tokenizer.encode(template.render([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in CORPUS_QUESTIONS]
    answers = [(await decode_speed(off, ids, args.max_tokens, 0.0, 0))[1] for ids in prompts]
    corpus = tmp / "answers.jsonl"
    corpus.write_text("".join(json.dumps(off.tokenizer.decode(a)) + "\n" for a in answers))
    trees = dict(common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.draft_tokens,
                 speculative_ngram_min_match_window_size=args.min_window,
                 speculative_ngram_max_bfs_breadth=args.bfs_breadth)
    # The same trees without the corpus: what the questions' first asking gets from the trie alone.
    engines = {"off": off, "ngram_corpus_chat": Engine.from_args(ServerArgs(
                   **trees, speculative_ngram_external_corpus_path=str(corpus),
                   speculative_ngram_external_sam_budget=args.sam_budget)),
               "ngram_trees_fresh_chat": Engine.from_args(ServerArgs(**trees))}
    speeds = {name: [] for name in engines}
    identical = {name: 0 for name in engines}
    counters = {}
    for name, engine in engines.items():
        if engine is not off:
            await engine.start()
            await decode_speed(engine, prompts[0], 8, 0.0, 0)  # warm-up
            counters[name] = (engine.metrics.spec_verify_steps, engine.metrics.spec_emitted_tokens)
    for r, ids in enumerate(prompts[1:]):
        outputs = {}
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            speed, outputs[name] = await decode_speed(engines[name], ids, args.max_tokens, 0.0, 0)
            speeds[name].append(speed)
        for name in engines:
            identical[name] += outputs[name] == outputs["off"]
    result = {}
    off_s = statistics.median(speeds["off"])
    for name, (steps0, emitted0) in counters.items():
        m, on_s = engines[name].metrics, statistics.median(speeds[name])
        result[name] = {"corpus_tokens": sum(map(len, answers)), "off_tok_s": round(off_s, 1),
                        "on_tok_s": round(on_s, 1), "ratio": round(on_s / off_s, 2),
                        "accept_len": round((m.spec_emitted_tokens - emitted0) / max(m.spec_verify_steps - steps0, 1),
                                            2),
                        "identical_outputs": f"{identical[name]}/{len(prompts) - 1}"}
        print(name, json.dumps(result[name]), flush=True)
    for engine in engines.values():
        await engine.shutdown()
    return result


def step_costs(args, model_dir: Path) -> dict:
    """Median ms of a decode step of --rows rows, each one token after the
    same prompt, and of that step with 1, 3 and 6 drafts in its first row,
    alternated over --rounds x 20 steps; with more than one row, a one-row
    decode step too, the unit a draft's cost is counted in (the decode
    step itself with one row)."""
    import torch

    from pyserve.engine.runner.rank_model import RankModel
    from pyserve.model.forward_batch import ForwardBatch
    from pyserve.server_args import ServerArgs

    options = ServerArgs(model_path=str(model_dir), device=args.device, max_total_tokens=4096,
                         torchao_config=args.torchao_config).resolved().split().model
    rank = RankModel(options, model_dir, torch.device(options.device))
    rank.allocate(rank.num_pages())
    prompt, room = 278, 8
    slots = torch.arange(1, prompt + room * args.rows + 1)
    generator = torch.Generator().manual_seed(0)

    def step(new: list[int]) -> ForwardBatch:
        """Rows of new[r] tokens after the prompt's (a decode row's and its drafts)."""
        ids, positions, out, kv, logits = [], [], [], [], []
        for r, n in enumerate(new):
            own = slots[prompt + room * r:prompt + room * r + n]
            logits += range(len(ids), len(ids) + n)
            ids += torch.randint(3, 5000, (n,), generator=generator).tolist()
            positions += range(prompt, prompt + n)
            out.append(own)
            kv.append(torch.cat([slots[:prompt], own]))
        return ForwardBatch.build(ids, positions, torch.cat(out), new, kv, logits, max(new) == 1, options.device)

    rows = args.rows
    steps = {"decode": step([1] * rows),
             **{f"verify_{k}_drafts": step([k + 1] + [1] * (rows - 1)) for k in (1, 3, 6)}}
    if rows > 1:
        steps["one_row_decode"] = step([1])
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.inference_mode():
        rank.forward(ForwardBatch.build(list(range(3, 3 + prompt)), list(range(prompt)), slots[:prompt], [prompt],
                                        [slots[:prompt]], [prompt - 1], False, options.device))
        for _ in range(args.rounds * 20):
            for name, batch in steps.items():
                start = time.perf_counter()
                rank.forward(batch).argmax(-1).tolist()
                times[name].append(time.perf_counter() - start)
    decode = statistics.median(times["decode"])
    result = {}
    for name, batch in steps.items():
        ms = statistics.median(times[name])
        result[name] = {"ms": round(ms * 1e3, 2), "x_decode": round(ms / decode, 2),
                        "plan": rank.plan(batch).layers.value, "torch_threads": rank.plan(batch).torch_threads}
        print(name, json.dumps(result[name]), flush=True)
    # What one draft adds to the step, in one-row decode steps (Drafter.draft_cost).
    one_row = statistics.median(times["one_row_decode"]) if rows > 1 else decode
    result["draft_x_one_row_decode"] = round((statistics.median(times["verify_6_drafts"]) - decode) / 6 / one_row, 3)
    print("draft_x_one_row_decode", result["draft_x_one_row_decode"], flush=True)
    return result


def head_cost(args, model_dir: Path, tmp: Path) -> dict:
    """--head-cost: see the module's docstring."""
    import torch
    from safetensors.torch import save_file

    from pyserve.engine.runner.rank_model import RankModel
    from pyserve.engine.speculative.eagle import EagleDraft
    from pyserve.model.eagle_head import EagleConfig
    from pyserve.model.forward_batch import ForwardBatch
    from pyserve.server_args import ServerArgs

    options = ServerArgs(model_path=str(model_dir), device=args.device, max_total_tokens=4096,
                         torchao_config=args.torchao_config).resolved().split().model
    rank = RankModel(options, model_dir, torch.device(options.device))
    rank.allocate(rank.num_pages())
    c = rank.config
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0,
           "max_position_embeddings": 4096, "vocab_size": c.vocab_size}
    g = torch.Generator().manual_seed(0)
    h, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter),
              "layers.0.post_attention_layernorm.weight": (h,)}
    head_dir = tmp / "eagle-head"
    head_dir.mkdir()
    save_file({name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()},
              str(head_dir / "model.safetensors"))
    (head_dir / "config.json").write_text(json.dumps(cfg))
    heads = {"whole_vocabulary": None, "token_map_32768": torch.arange(32768), "token_map_8192": torch.arange(8192)}
    drafts = {name: EagleDraft(head_dir, EagleConfig(head_dir), rank, model_dir, options, None, hot)
              for name, hot in heads.items() if hot is None or len(hot) < c.vocab_size}
    prompt = 278
    slots = torch.arange(1, prompt + 2)
    decode = ForwardBatch.build([11], [prompt], slots[prompt:], [1], [slots], [0], True, options.device)
    hidden = torch.randn(1, h, generator=g).to(options.device, rank.dtype)
    times: dict[str, list[float]] = {name: [] for name in ["target_decode", *drafts]}
    with torch.inference_mode():
        rank.forward(ForwardBatch.build(list(range(3, 3 + prompt)), list(range(prompt)), slots[:prompt], [prompt],
                                        [slots[:prompt]], [prompt - 1], False, options.device))
        for _ in range(args.rounds * 20):
            start = time.perf_counter()
            rank.forward(decode).argmax(-1).tolist()
            times["target_decode"].append(time.perf_counter() - start)
            for name, draft in drafts.items():
                start = time.perf_counter()
                logits, _ = draft.head(decode.input_ids, hidden, decode, draft.attention)
                draft.head.target_logits(logits, c.vocab_size).argmax(-1).tolist()
                times[name].append(time.perf_counter() - start)
    unit = statistics.median(times["target_decode"])
    result = {}
    for name, values in times.items():
        ms = statistics.median(values)
        result[name] = {"ms": round(ms * 1e3, 3), "x_target_decode": round(ms / unit, 3)}
        print(name, json.dumps(result[name]), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--torchao-config", default="auto", help="CPU quantization mode; none = float32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft-tokens", type=int, default=6, help="NGRAM: --speculative-num-draft-tokens")
    p.add_argument("--min-window", type=int, default=3, help="--speculative-ngram-min-match-window-size")
    p.add_argument("--bfs-breadth", type=int, default=4,
                   help="ngram_trees: --speculative-ngram-max-bfs-breadth")
    p.add_argument("--corpus", action="store_true",
                   help="NGRAM trees drafting from a corpus of earlier answers instead (see above)")
    p.add_argument("--sam-budget", type=int, default=3, help="--corpus: --speculative-ngram-external-sam-budget")
    p.add_argument("--draft-layers", type=int, default=10, help="STANDALONE: the target's layers the draft keeps")
    p.add_argument("--draft-steps", type=int, default=4, help="STANDALONE, EAGLE3: --speculative-num-steps")
    p.add_argument("--eagle3-head", default=None,
                   help="an EAGLE-3 head trained for --model (SGLang's format): adds EAGLE3 rows")
    p.add_argument("--only", nargs="*", help="row names to run (default: all)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="copies of each row's request at once; above 1 the figure is the batch's output tok/s "
                        "over its wall time")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="overlap scheduling in every engine (auto: the server's default, on CUDA without speculation)")
    p.add_argument("--step-costs", action="store_true",
                   help="time one decode step against verify steps of 1, 3 and 6 drafts instead")
    p.add_argument("--rows", type=int, default=1, help="--step-costs: the decode step's rows")
    p.add_argument("--head-cost", action="store_true",
                   help="time an EAGLE head's draft step with and without token maps instead")
    args = p.parse_args(argv)
    from pyserve.model.default_model import default_model_path

    model_dir = Path(args.model) if args.model else default_model_path()
    if args.step_costs:
        result = step_costs(args, model_dir)
        result["machine"] = platform.machine()
        return result
    if args.head_cost:
        with tempfile.TemporaryDirectory() as tmp:
            result = head_cost(args, model_dir, Path(tmp))
        result["machine"] = platform.machine()
        return result
    if args.corpus:
        cost = corpus_cost(model_dir)
        with tempfile.TemporaryDirectory() as tmp:
            result = asyncio.run(corpus_run(args, model_dir, Path(tmp)))
        result["corpus_cost"] = cost
        result["machine"] = platform.machine()
        return result
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = truncated_draft(model_dir, Path(tmp) / "draft", args.draft_layers)
        result = asyncio.run(run(args, model_dir, draft_dir))
    result["machine"] = platform.machine()
    result["draft"] = f"the target's first {args.draft_layers} layers"
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
