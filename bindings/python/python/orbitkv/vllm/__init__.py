"""OrbitKV's vLLM integration: ``orbitkv.vllm.pd.PdConnector``.

Importing this package does not import vLLM; ``orbitkv.vllm.pd`` does.
"""
