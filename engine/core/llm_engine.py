"""The engine loop: requests in, scheduler step, model step, outputs out."""
from __future__ import annotations

import time
from itertools import count

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.beam_search import BeamSearch
from engine.core.block_manager import BlockManager, adapter_root, prefix_block_hashes
from engine.core.outputs import EmbeddingOutput, RequestOutput, StepResult, StepStats, request_output
from engine.core.pooling import Pooling, PooledState, check_dimensions, pooled_positions, read_pooling
from engine.core.prompt_logprobs import prompt_spans
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.step_builder import StepBuilder
from engine.execution.model_runner import ModelRunner
from engine.inputs.detokenizer import Detokenizer
from engine.inputs.multimodal import ImagePrompts, MultimodalPrompt, chat_parts
from engine.inputs.tokenizer import load_tokenizer
from engine.layers.rotary import long_rope_rows
from engine.lora.adapter import check_adapter
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.models import model_class
from engine.runner import GrammarMasks, Runner, StepInputs
from engine.sampling.grammar import GrammarCache
from engine.sampling.grammar_mask import MaskBuilder
from engine.sampling.params import BeamSearchParams, SamplingParams, constraint


# LLM.embed keeps at most this many requests per sequence slot in the engine, adding the rest as they finish
EMBED_WINDOW_PER_SLOT = 4
# every embedding request's sequence holds these (prefill only: nothing reads them but the scheduler)
EMBED_PARAMS = SamplingParams(temperature=0, max_tokens=1)


class LLMEngine:
    """Continuous-batching engine. Drive it with add_request/step, or call generate for a whole batch."""

    def __init__(self, model: str | EngineConfig, **kwargs):
        """`model`: an HF hub id, a local directory or a built-in name, with the EngineConfig options as
        keyword arguments; or an EngineConfig already built."""
        self.config = config = model if isinstance(model, EngineConfig) else EngineConfig(model, **kwargs)
        self.runner: Runner = self._make_runner(config)
        self.tokenizer = load_tokenizer(config.model_dir)
        # a vision-language model's image preprocessing (None for text models)
        self.images = None
        if getattr(config.hf_config, "vision_config", None) is not None:
            self.images = ImagePrompts(config.model_dir, config.hf_config, config.max_images_per_prompt,
                                       config.max_image_bytes, config.max_pixels_per_prompt)
        self.vocab_size = config.text_config.vocab_size
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, config.eos_token_id)
        self.masks = MaskBuilder(self.vocab_size, self.runner.device)  # structured output's, on the host
        # LongRoPE: past which length a sequence rotates with the long factors, and where their table rows start
        long_after, long_row = long_rope_rows(config.text_config) or (None, 0)
        self.steps = StepBuilder(config.kvcache_block_size, self.runner.uses_mrope, self.vocab_size,
                                 config.eos_token_id, long_row)
        # where every layer slides (Mistral), blocks before the widest window are handed back as sequences grow
        windows = model_class(config.hf_config.architectures).layer_windows(config.hf_config)
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, long_after,
                                          max(windows) if all(windows) else 0)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefer_cached_prefixes and config.enable_prefix_caching,
                                   LoRASlots(config.max_loras) if config.enable_lora else None)
        self._lora_paths: dict[int, str] = {}  # each adapter int_id checked so far, and its path
        self.requests: dict[str, SequenceGroup] = {}
        self._aborted: list[SequenceGroup] = []
        self._request_ids = count()
        # async scheduling: the launch whose tokens are still on their way (resolved in the next step)
        self.async_scheduling = bool(config.async_scheduling)
        self._inflight: _InFlight | None = None
        self._pooling: Pooling | None = None  # the model's, read at its first embedding request
        self._scoring: set[str] = set()  # requests whose prompt logprobs are not all in yet
        self._embedding: set[str] = set()  # embedding requests not finished yet
        self._shut_down = False

    def _make_runner(self, config: EngineConfig) -> Runner:
        if config.tensor_parallel_size > 1:
            from engine.execution.distributed import TPDriver
            return TPDriver(config)
        return ModelRunner(config)

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int] | dict | MultimodalPrompt,
                    sampling_params: SamplingParams | BeamSearchParams | dict | None = None,
                    request_id: str | None = None, stream: bool = False, lora_request: LoRARequest | None = None) -> str:
        """Queue one request (sampling, or beam search with BeamSearchParams); returns its id. A prompt is
        text, token ids, {"prompt": text or ids, "images": [PIL.Image | bytes | path | data URL, ...]} (a
        vision-language model), or what prepare_prompt / encode_chat returned. stream: its outputs carry
        each step's new text (`new_text`), not only the final text. lora_request: the LoRA adapter it runs
        under (None: the base model). Raises ValueError for bad input, leaving the engine as it was."""
        self._check_open()
        if not self.runner.has_lm_head:
            raise ValueError(f"model {self.config.model!r} has no LM head (an embedding checkpoint): it cannot "
                             "generate; use embed()")
        params = _as_params(sampling_params)
        if lora_request is not None:
            self._check_lora(lora_request)
        prepared = self.prepare_prompt(prompt)
        token_ids = self._check_length(prepared.token_ids if isinstance(prepared, MultimodalPrompt) else prepared)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        group = self._new_group(request_id, token_ids, params, stream)
        group.first.lora = lora_request
        if isinstance(prepared, MultimodalPrompt):
            group.first.multimodal = prepared.multimodal
            group.first.mrope_position_delta = prepared.multimodal.mrope_position_delta
        self.requests[request_id] = group
        if group.prompt_logprobs is not None and not group.prompt_logprobs.done:
            self._scoring.add(request_id)
        self.scheduler.add(group.first)
        return request_id

    def _check_lora(self, lora: LoRARequest) -> None:
        """An adapter this engine can run: read and checked from disk the first time its int_id comes."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.config.enable_lora:
            raise ValueError("a LoRA request needs an engine started with enable_lora=True")
        known = self._lora_paths.get(lora.int_id)
        if known is None:
            check_adapter(lora.name, lora.path, self.config.max_lora_rank,
                          model_class(self.config.hf_config.architectures).packed_modules, self.runner.lora_modules)
            self._lora_paths[lora.int_id] = lora.path
        elif known != lora.path:
            raise ValueError(f"LoRA int_id {lora.int_id} names adapter {known!r}; {lora.path!r} needs an id of its own")

    def add_embed_request(self, prompt: str | list[int], dimensions: int | None = None,
                          request_id: str | None = None) -> str:
        """Queue one embedding request (text, through the tokenizer with its own post-processing, or token
        ids); returns its id. Its output, an EmbeddingOutput, comes once, finished. dimensions: keep the
        first this many values, L2-normalised again (matryoshka). Raises ValueError for bad input."""
        self._check_open()
        if self._pooling is None:
            self._pooling = read_pooling(self.config.model_dir)
        dimensions = check_dimensions(dimensions, self.config.text_config.hidden_size)
        if self.images is not None:
            raise ValueError(f"model {self.config.model!r} is a vision-language model; embeddings need a text model")
        token_ids = self._encode(prompt)
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"input has {len(token_ids)} tokens; max_model_len is {self.config.max_model_len}")
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        group = SequenceGroup(request_id, token_ids, EMBED_PARAMS, self.config.kvcache_block_size)
        group.first.pooling = PooledState(self._pooling, dimensions)
        self.requests[request_id] = group
        self._embedding.add(request_id)
        self.scheduler.add(group.first)
        return request_id

    def prefix_block_hashes(self, token_ids: list[int], lora_request: LoRARequest | None = None) -> list[int]:
        """The prefix-cache hashes of a text prompt's leading KV blocks (block_manager.prefix_block_hashes), under
        `lora_request`'s adapter if given; callable on any thread."""
        root = -1 if lora_request is None else adapter_root(lora_request.int_id)
        return prefix_block_hashes(token_ids, self.config.kvcache_block_size, root)

    def num_cached_blocks(self, hashes: list[int]) -> int:
        """How many of those leading blocks the prefix cache holds now: a hint, readable on any thread."""
        return self.block_manager.num_cached_blocks(hashes)

    def compile_grammar(self, params) -> None:
        """Compile the structured-output constraint of `params` (SamplingParams or the wire's Sampling) into
        the engine's grammar cache now, on the caller's thread, so that add_request finds it compiled.
        Thread-safe; an error is left for add_request to raise."""
        given = constraint(params)
        if given is not None:
            try:
                self.grammars.compile(*given)
            except ValueError:
                pass

    def _new_group(self, request_id: str, token_ids: list[int], params, stream: bool = False) -> SequenceGroup:
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = BeamSearch(params, self.config.eos_token_id)
            if beam.num_candidates > self.vocab_size:
                raise ValueError(f"beam_width={beam.width} ranks {beam.num_candidates} candidates a step; the "
                                 f"vocabulary has {self.vocab_size} tokens")
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        group = SequenceGroup(request_id, token_ids, params, self.config.kvcache_block_size, beam)
        group.streams = stream
        cap = self.config.max_seqs_per_request
        if group.width > cap:
            name = "beam_width" if beam is not None else ("best_of" if params.best_of else "n")
            raise ValueError(f"{name}={group.width} needs {group.width} sequences at once; max_num_seqs is "
                             f"{self.config.max_num_seqs}, of which one request may hold {cap} "
                             f"(max_seqs_per_request): ask for at most {cap}")
        bad = next((t for t in (params.logit_bias or ()) if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary "
                             f"(ids must be in [0, {self.vocab_size}))")
        seq = group.first
        if not isinstance(params, BeamSearchParams) and params.constraint is not None:
            seq.grammar = self.grammars.compile(*params.constraint).state()
        if beam is None and self.tokenizer is not None and (stream or params.stop):
            seq.detokenizer = Detokenizer(self.tokenizer, params.stop)
        limit = self.config.max_model_len
        seq.max_num_tokens = limit if params.max_tokens is None else min(len(token_ids) + params.max_tokens, limit)
        if beam is not None:
            beam.max_tokens = seq.max_num_tokens - len(token_ids)
            beam.beams = [seq]
        return group

    def prepare_prompt(self, prompt) -> list[int] | MultimodalPrompt:
        """Token ids of a prompt, or with images a MultimodalPrompt (the images loaded, preprocessed and
        their placeholders expanded): the host's work of add_request, callable on another thread first."""
        if isinstance(prompt, MultimodalPrompt):
            return prompt
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "images"}
            if unknown or "prompt" not in prompt:
                raise ValueError(f"a dict prompt has the keys 'prompt' and 'images', got {sorted(prompt)}")
            images = prompt.get("images") or []
            if images:
                if self.images is None:
                    raise ValueError(f"model {self.config.model!r} takes no images (it is a text model)")
                return self.images.prepare(self._encode(prompt["prompt"]), images)
            prompt = prompt["prompt"]
        token_ids = self._encode(prompt)
        if self.images is not None:
            self.images.check_text(token_ids)
        return token_ids

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer files; pass the prompt as a list of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(issubclass(t, int) and t is not bool
                                                       for t in set(map(type, prompt))):  # types, not tokens
            token_ids = list(prompt)
            if token_ids and not (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
                bad = next(i for i, t in enumerate(token_ids) if not 0 <= t < self.vocab_size)
                raise ValueError(f"token id {token_ids[bad]} at position {bad} is outside the vocabulary "
                                 f"(ids must be in [0, {self.vocab_size}))")
        else:
            raise ValueError(f"a prompt must be a string or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        return token_ids

    def _check_length(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {self.config.max_model_len} "
                             f"(prompt plus at least one generated token)")
        return token_ids

    def encode_chat(self, messages: list[dict]) -> list[int] | MultimodalPrompt:
        """Token ids of chat `messages` through the tokenizer's chat template, ready for generation; with
        image parts ({"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}, a
        vision-language model) a MultimodalPrompt, its images preprocessed."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a prompt or token ids instead of messages")
        messages, images = chat_parts(messages)
        if images and self.images is None:
            raise ValueError(f"model {self.config.model!r} takes no images (it is a text model)")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if images:
            return self.images.prepare(list(ids), images)
        return list(ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; the next step() reports it with finish_reason "abort"."""
        group = self.requests.get(request_id)
        if group is None or group.is_finished:
            return False
        self._end(group)
        self._aborted.append(group)
        return True

    def _end(self, group: SequenceGroup) -> None:
        """Finish every sequence of `group` still going with "abort"."""
        now = time.monotonic()
        for seq in group.live_seqs():
            self._finish(seq, "abort", now)
            seq.truncate(seq.num_prompt_tokens + seq.num_resolved_completion_tokens)
        if group.beam is not None:
            group.beam.done = True
        group.finished_time = now

    def _finish(self, seq: Sequence, reason: str | None, now: float) -> None:
        self.scheduler.finish(seq, reason)
        self.steps.finished(seq)  # the runner frees its state with the next step
        seq.finished_time = now

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._inflight is not None

    def num_free_slots(self) -> int:
        """How many more requests the engine can start now (free sequence slots and KV blocks)."""
        sched = self.scheduler
        if sched.waiting and not self.block_manager.can_allocate(sched.waiting[0]):
            return 0
        waiting_blocks = sum(s.num_blocks for s in sched.waiting)  # forks share them
        return max(0, min(sched.num_free_slots(), self.block_manager.num_free_blocks - waiting_blocks))

    # ---- the step ---------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> StepResult:
        """One scheduling decision and one forward pass. Outputs cover every request that got tokens in
        this step, or with `finished_only` the finished ones and those added with stream=True (building an
        output decodes its text: a step of hundreds of requests saves that for the ones nobody reads).

        With async scheduling the step launches its forward pass, then collects the tokens of the previous
        step's launch, so the host prepares step N+1 while the device runs step N."""
        self._check_open()
        start = time.perf_counter()
        bm, sched = self.block_manager, self.scheduler
        queries, hits, preemptions = bm.num_cache_queries, bm.num_cache_hits, sched.num_preemptions
        outputs = [self._output_or_fail(group) for group in self._aborted]
        self._aborted.clear()
        batch = sched.schedule()
        while not batch and self._inflight is None and sched.waiting and sched.running:
            sched.make_room_for_waiting()  # the running ones are idle beams: nothing runs otherwise
            batch = sched.schedule()
        stats = StepStats()
        launched = None
        if batch:
            self._mark_scheduled(batch)
            to_sample = batch.sampled()
            stats.num_decode_tokens = sum(1 for s, n in zip(batch.seqs, batch.num_tokens)
                                          if n == 1 and s.num_completion_tokens > 0 and s.num_uncomputed_tokens == 1)
            stats.num_prefill_tokens = batch.total_tokens - stats.num_decode_tokens
            spans = prompt_spans(batch) if self._scoring else []  # no per-sequence check on most steps
            inputs = self.steps.build(batch, to_sample, spans)
            launched = self._launch(batch, to_sample, inputs, finished_only, outputs, spans)
            if not self.async_scheduling:  # a synchronous step is a launch collected at once
                outputs += self._collect(launched, finished_only)
                launched = None
        if self._inflight is not None:
            outputs += self._collect(self._inflight, finished_only)
        self._inflight = launched
        stats.num_running, stats.num_waiting = len(sched.running), len(sched.waiting)
        stats.kv_cache_usage = bm.usage
        stats.num_preemptions = sched.num_preemptions - preemptions
        stats.prefix_cache_queries = bm.num_cache_queries - queries
        stats.prefix_cache_hits = bm.num_cache_hits - hits
        stats.batch_size = len(batch.seqs)
        stats.step_seconds = time.perf_counter() - start
        return StepResult(outputs, stats)

    def _mark_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            first = seq.group.first
            first.first_scheduled_time = first.first_scheduled_time or now
            if seq.grammar is not None and seq.num_computed_tokens == 0:  # (re)computed from its start
                seq.grammar.restart()

    def _launch(self, batch: ScheduledBatch, sampled: list[Sequence], inputs: StepInputs, finished_only: bool,
                collected: list[RequestOutput], spans: list) -> "_InFlight":
        """Queue the step on the device and advance the sequences as if it were done; each sampled
        sequence gets a -1 placeholder, filled when the step is collected (the next step's inputs take
        it from the device meanwhile). The runner executes the model, then (a step with constrained rows)
        the engine computes their masks (_masks, which may collect the launch in flight into `collected`),
        then the runner samples."""
        pooled = [(seq, seq.num_computed_tokens, n) for seq, n in zip(batch.seqs, batch.num_tokens)
                  if seq.pooling is not None] if self._embedding else []  # no per-sequence check on most steps
        scored = [(seq, start, count) for _, seq, start, count in spans]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        positions = []
        for i, seq in enumerate(sampled):
            positions.append(seq.num_tokens)
            if seq.group.beam is None:  # a beam's next token is chosen once every beam's step is in
                seq.pending_index = i
                seq.append_token(-1)
        executed = self.runner.execute_model(inputs)
        masks = None
        if inputs.sampling is not None and inputs.sampling.grammar_rows:
            masks = self._masks(sampled, inputs.sampling.grammar_rows, finished_only, collected)
        tokens = self.runner.sample_tokens(executed, masks)
        return _InFlight(batch, sampled, positions, tokens, pooled, executed.pooled, scored)

    def _masks(self, sampled: list[Sequence], index: list[int], finished_only: bool,
               collected: list[RequestOutput]) -> GrammarMasks:
        """The allowed-token masks of the constrained rows `index` of `sampled`. They depend on the tokens
        the launch in flight is still sampling: the step's forward pass queued, the step collects that
        launch now (what the end of step() would do) and starts the masks once its tokens are in place,
        so that they are computed on the host while the device runs the forward pass and the rest of the
        collecting goes on; the step's sampling follows them."""
        started = []

        def start() -> None:
            started.append(self.masks.start(sampled, index))
        if self._inflight is None:
            start()
        else:
            step, self._inflight = self._inflight, None
            collected += self._collect(step, finished_only, start)
        return self.masks.finish(started[0])

    def _collect(self, step: "_InFlight", finished_only: bool, tokens_placed=None) -> list[RequestOutput]:
        token_ids, logprobs = step.tokens.result()
        if step.scored:
            self._take_prompt_scores(step.scored, step.tokens.prompt_result())
        outputs = self._postprocess(step.batch, step.sampled, step.positions, token_ids, logprobs, finished_only,
                                    tokens_placed)
        if step.pooled:
            outputs += self._take_pooled(step.pooled, step.pooled_sums)
        return outputs

    def _take_pooled(self, chunks: list[tuple[Sequence, int, int]], pooled_sums) -> list[EmbeddingOutput]:
        """Add each embedding chunk's pooled sum (a chunk with rows to pool has one, in order) to its request's;
        the requests whose prompt is done finish (after _postprocess entered their blocks in the prefix cache)."""
        sums = iter(pooled_sums.result() if pooled_sums is not None else ())
        outputs, now = [], time.monotonic()
        for seq, start, n in chunks:
            state = seq.pooling
            chunk_sum = next(sums) if pooled_positions(state.pooling.method, start, start + n, seq.num_tokens) else None
            if seq.is_finished:  # aborted meanwhile
                continue
            if chunk_sum is not None:
                state.add(chunk_sum, start)
            if start + n == seq.num_tokens:
                self._finish(seq, "stop", now)
                seq.group.finished_time = now
                outputs.append(self._output(seq.group))
        return outputs

    def _take_prompt_scores(self, scored: list[tuple[Sequence, int, int]], scores) -> None:
        """Each scored chunk's rows of the step's prompt logprobs into its request's (before its outputs are
        built)."""
        logprobs, ranks, top_values, top_ids = scores
        row = 0
        for seq, start, count in scored:
            end, group = row + count, seq.group
            if not seq.is_finished:
                group.prompt_logprobs.add(start, logprobs[row:end], ranks[row:end],
                                          None if top_values is None else top_values[row:end],
                                          None if top_ids is None else top_ids[row:end])
                if group.prompt_logprobs.done:
                    self._scoring.discard(group.request_id)
            row = end

    def _postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], positions: list[int],
                     token_ids: list[int], logprobs, finished_only: bool, tokens_placed=None):
        """Put each sampled token at its position (then call tokens_placed(), if given), enter computed
        blocks in the prefix cache, finish what is done; beam search takes its beams' top logprobs instead."""
        live = [(i, seq, pos, tok) for i, (seq, pos, tok) in enumerate(zip(sampled, positions, token_ids))
                if not seq.is_finished]  # aborted, or finished by the step before
        for _, seq, pos, tok in live:
            if seq.group.beam is not None:
                continue
            if pos == seq.num_tokens:
                seq.append_token(tok)
            else:
                seq.token_ids[pos] = tok
                seq.completion_token_ids[pos - seq.num_prompt_tokens] = tok
        if tokens_placed is not None:
            tokens_placed()
        for seq in batch.seqs:
            if not seq.is_finished:
                self.block_manager.register_computed(seq)
        now = time.monotonic()
        chosen, top_values, top_ids = logprobs
        outputs, touched = [], {}
        for i, seq, pos, token_id in live:
            group = seq.group
            if seq.is_finished:  # its request failed on an earlier row of this step
                continue
            try:
                first = group.first
                first.first_token_time = first.first_token_time or now
                if group.beam is not None:
                    if pos == seq.num_tokens and self._report_beam(group, seq, top_values[i], top_ids[i]):
                        touched[group.request_id] = group
                    continue
                seq.cumulative_logprob += chosen[i]
                if seq.grammar is not None:
                    seq.grammar.follow(seq.completion_token_ids)
                if seq.params.logprobs is not None:
                    k = seq.params.logprobs
                    top = dict(zip(top_ids[i][:k], top_values[i][:k])) if top_ids is not None else {}
                    seq.logprobs.append({"token_id": token_id, "logprob": chosen[i], "top": top})
                reason = self._finish_reason(seq, token_id, pos + 1)
                finished = False
                if reason is not None:
                    self._finish(seq, reason, now)
                    seq.truncate(pos + 1)  # a later launch's placeholder is no part of the output
                    finished = group.is_finished
                    if finished:
                        group.finished_time = now
                if finished or not finished_only or group.streams:
                    touched[group.request_id] = group
            except Exception as e:  # noqa: BLE001 - this request's own data (stop strings, text) raised
                touched.pop(group.request_id, None)
                outputs.append(self._fail(group, e))
        outputs += [self._output_or_fail(group) for group in touched.values()]
        return outputs

    def _report_beam(self, group: SequenceGroup, seq: Sequence, top_values: list[float], top_ids: list[int]) -> bool:
        """Take a beam's candidates; once every beam has reported, the next beams replace them (forked from
        the chosen ones, sharing their blocks). True when the search moved on."""
        beam = group.beam
        k = beam.num_candidates
        beam.report(seq, top_values[:k], top_ids[:k])
        if not beam.ready:
            return False
        extensions = beam.select()
        now = time.monotonic()
        kept, next_beams = set(), []
        for ext in extensions:  # fork before any parent takes its token
            parent = ext.parent
            if parent.seq_id in kept:
                child = self.scheduler.fork(parent, [len(next_beams)], parent.num_computed_tokens)[0]
            else:
                child = parent
                kept.add(parent.seq_id)
            next_beams.append(child)
        for child, ext in zip(next_beams, extensions):
            child.append_token(ext.token_id)
            child.beam_score = ext.score
            child.cumulative_logprob = float(ext.score)
        for old in beam.beams:
            if old.seq_id not in kept:
                self._finish(old, None, now)
        beam.beams = group.seqs = next_beams or group.seqs
        group.forked = True
        if beam.done:
            for old in group.live_seqs():
                self._finish(old, None, now)
            group.finished_time = now
        return True

    def _fail(self, group: SequenceGroup, error: Exception) -> RequestOutput:
        """End one request whose own data raised: it finishes "abort" with the error, the others go on.
        A fault of the engine itself (the forward pass, a device error) is never caught: it stops step()."""
        group.error = f"the request failed while its tokens were processed: {type(error).__name__}: {error}"
        if not group.is_finished:
            self._end(group)
        for seq in group.seqs:
            seq.finish_reason = "abort"
        return self._output(group)

    def _finish_reason(self, seq: Sequence, token_id: int, num_tokens: int) -> str | None:
        """Why `seq` ends with `token_id` as its token number `num_tokens`, or None if it goes on."""
        p = seq.params
        past_min = num_tokens - seq.num_prompt_tokens >= p.min_tokens  # before min_tokens only the length ends it
        if past_min:
            if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.config.eos_token_id):
                return "stop"
            if seq.grammar is not None and seq.grammar.done:  # a whole match that nothing may extend
                return "stop"
        # the text of a request that needs it as it comes, stop strings found in the same pass
        if seq.detokenizer is not None and seq.detokenizer.update(
                seq.completion_token_ids, num_tokens - seq.num_prompt_tokens, past_min):
            return "stop"
        if num_tokens >= seq.max_num_tokens:
            return "length"
        return None

    def _output_or_fail(self, group: SequenceGroup) -> RequestOutput:
        try:
            return self._output(group)
        except Exception as e:  # noqa: BLE001 - decoding its text raised
            return self._fail(group, e)

    def _output(self, group: SequenceGroup) -> RequestOutput | EmbeddingOutput:
        if group.is_finished:
            self.requests.pop(group.request_id, None)
            self._scoring.discard(group.request_id)
            self._embedding.discard(group.request_id)
        first = group.first
        if first.pooling is not None:
            done = first.finish_reason == "stop"
            return EmbeddingOutput(
                request_id=group.request_id, prompt_token_ids=group.prompt_token_ids,
                embedding=first.pooling.embedding(first.num_tokens) if done else None,
                finish_reason=first.finish_reason, error=group.error, num_cached_tokens=first.num_cached_tokens,
                arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                finished_time=group.finished_time)
        return request_output(group, self.tokenizer)

    # ---- batch API --------------------------------------------------------------------------------

    def generate(self, prompts: list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | BeamSearchParams | list | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt is text, token ids or, for a
        vision-language model, {"prompt": ..., "images": [...]} (add_request). sampling_params: one for all
        prompts or a list, one per prompt; lora_request likewise (None: the base model)."""
        if isinstance(prompts, (str, dict, MultimodalPrompt)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        if not isinstance(lora_request, list):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(lora_request)} LoRA requests")
        ids: list[str] = []
        try:
            for prompt, sp, lora in zip(prompts, sampling_params, lora_request):
                ids.append(self.add_request(prompt, sp, lora_request=lora))
        except Exception:
            self._drop(ids)
            raise
        return self._run(ids, "Generating", use_tqdm)

    def _drop(self, ids: list[str]) -> None:
        """Abort these requests and forget them: their outputs are never reported."""
        for rid in ids:
            self.abort(rid)
            self.requests.pop(rid, None)
            self._scoring.discard(rid)
            self._embedding.discard(rid)
        self._aborted.clear()

    def embed(self, inputs: str | list[str] | list[int] | list[list[int]], dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """Embed every input (text, or token ids) with an embedding model; one EmbeddingOutput per input, in
        order, with `.embedding`. Pooling and normalisation are the model's (engine/core/pooling.py);
        dimensions: keep the first this many values, L2-normalised again (matryoshka). The inputs are added
        as the engine works through them (at most EMBED_WINDOW_PER_SLOT x max_num_seqs in the engine at once),
        so a corpus's host work overlaps its steps; a bad input raises ValueError and drops the others."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        window = EMBED_WINDOW_PER_SLOT * self.config.max_num_seqs
        ids: list[str] = []
        wanted: set[str] = set()
        results: dict[str, EmbeddingOutput] = {}
        bar = tqdm(total=len(inputs), desc="Embedding", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while len(results) < len(inputs):
                while len(ids) < len(inputs) and len(self.requests) < window:
                    ids.append(self.add_embed_request(inputs[len(ids)], dimensions))
                    wanted.add(ids[-1])
                for out in self.step(finished_only=True).finished:
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except Exception:
            self._drop(ids)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]

    def _run(self, ids: list[str], desc: str, use_tqdm: bool) -> list:
        """Step until the requests `ids` are finished; their outputs in that order."""
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True, disable=not use_tqdm)
        prefill = decode = 0  # tokens and seconds of steps that did mostly prefill / mostly decode
        prefill_s = decode_s = 1e-9
        while len(results) < len(ids):
            res = self.step(finished_only=True)
            for out in res.finished:
                if out.request_id in wanted:
                    results[out.request_id] = out
                    bar.update(1)
            s = res.stats
            prefill, decode = prefill + s.num_prefill_tokens, decode + s.num_decode_tokens
            if s.num_prefill_tokens > s.num_decode_tokens:
                prefill_s += s.step_seconds
            else:
                decode_s += s.step_seconds
            if use_tqdm:
                bar.set_postfix(prefill=f"{prefill / prefill_s:.0f}tok/s", decode=f"{decode / decode_s:.0f}tok/s",
                                refresh=False)
        bar.close()
        return [results[rid] for rid in ids]

    def chat(self, conversations: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | BeamSearchParams | list | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """generate() for chat conversations (each a list of {"role", "content"} messages, or one such
        list), through the model's chat template; one output per conversation. A content may be a list of
        OpenAI-style parts, text and (a vision-language model) image_url with a data URL."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.encode_chat(list(c)) for c in conversations], sampling_params, use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: list[str] | list[list[int]], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beam search for every prompt; each output's .outputs are beam_width completions, best first (the
        beams transformers' generate(num_beams=beam_width, early_stopping=True) returns)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        return self.generate(prompts, params, use_tqdm)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("the engine was shut down; create a new one")

    def shutdown(self) -> None:
        """Release the engine's devices: the KV cache, CUDA graphs and weights are freed at once (the memory
        is free for another engine when this returns) and tensor-parallel ranks end. Requests still running
        are dropped; a step after this raises. Idempotent."""
        self._inflight = None
        self._shut_down = True
        self.runner.shutdown()


class _InFlight:
    """A launched step whose sampled tokens (and pooled sums) are still on their way to the host."""

    def __init__(self, batch: ScheduledBatch, sampled: list[Sequence], positions: list[int], tokens,
                 pooled: list[tuple[Sequence, int, int]], pooled_sums, scored: list[tuple[Sequence, int, int]]):
        self.batch, self.sampled, self.positions, self.tokens = batch, sampled, positions, tokens
        self.pooled, self.pooled_sums = pooled, pooled_sums  # embedding chunks: (seq, start, length), their sums
        self.scored = scored  # prompt chunks whose first rows score prompt tokens: (seq, start, rows)


class LLM(LLMEngine):
    """The offline entry point: LLM(model, ...).generate(prompts, params)."""


def _as_params(sp) -> SamplingParams | BeamSearchParams:
    if sp is None:
        return SamplingParams()
    if isinstance(sp, (SamplingParams, BeamSearchParams)):
        return sp
    if isinstance(sp, dict):
        try:
            return SamplingParams(**sp)
        except TypeError as e:
            raise ValueError(f"bad sampling params: {e}") from None
    raise ValueError(f"sampling_params must be SamplingParams, BeamSearchParams or a dict, got {type(sp).__name__}")
