"""The example RL job (see docs/example.md). Modules, one job each:

* ``task``           - synthetic digit task with an exact reward
* ``model``          - megatron-core GPT builder, GPT-2-layout weight export, plain-torch KV-cache decoder
* ``rollout_engine`` - embedded engine with SGLang ``/generate`` semantics (bf16 KV-cache decoding)
* ``quant``          - weight-only int8 / fp8 quantisation of the engine's linear layers
* ``measure_mismatch`` - paired mismatch of engine variants on the same weights and rollouts
* ``http_server``    - the embedded engine served over HTTP (``/generate``, ``/update_weights_from_disk``)
* ``http_client``    - SGLang HTTP client used for ``--sglang-url``
* ``weight_sync``    - the one weight-update interface (in-process copy / update from disk) and rollout lag
* ``rollout``        - one rollout step: prompts, request, parse, batch
* ``batch``          - responses -> padded training rows (via ``slime_tis.sglang``), GRPO advantages
* ``checkpoint``     - megatron dist checkpoints (sharded; resume at any PP/DP layout, bit-identical at the same)
* ``run_log``        - JSONL, TensorBoard, progress bar
* ``dist``, ``cpu_compat`` - process groups; megatron-core on CPU when CUDA is absent (``cpu_compat`` is also the
  test suite's CPU layer)
* ``train``          - the launcher (``python -m examples.rl.train``)
"""
