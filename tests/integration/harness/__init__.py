"""The parts of the vLLM test harness; import them through ``tests/integration/vllm_harness.py``.

    values       HarnessError, KVMismatchError, token fingerprints, expected KV bits.
    config       HarnessConfig and vLLM's own configs built from it (tiny Llama, VllmConfig,
                 KVCacheConfig), connectors through vLLM's factory, requests.
    runner_state what the fake runner tracks per request (token ids, per-group block tables).
    runner       FakeModelRunner (KV views, exact checks, the worker connector's call order)
                 and check_kv.
    engine       Harness, the EngineCore loop (HarnessEngine), workloads and run results.
    offloading   vLLM's OffloadingConnector with a CPU stand-in worker.
    recording    RecordingConnector, which records the connector protocol.

Each imports only the ones listed above it (offloading: engine; recording: none of them).
"""
