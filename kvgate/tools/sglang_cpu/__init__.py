"""What a real SGLang engine needs to run on this kind of machine's CPU: the ``sgl_kernel`` stand-in
(put first on the engine's PYTHONPATH by kvgate.tools.sglang_engine) and the tiny model directory builder
(make_model.py, run by the engine's own interpreter, which has ``tokenizers`` and ``transformers``).

Nothing here is imported by kvgate itself: both run inside the engine's virtual environment."""
