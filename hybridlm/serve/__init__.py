"""Serving exports with vLLM (``pip install 'hybrid-lm-toolkit[serve]'``, or ``[serve-cpu]``).

vLLM finds :func:`hybridlm.serve.plugin.register` through the ``vllm.general_plugins`` entry point and runs it
in each of its processes: ``vllm serve runs/.../final`` then loads a ``HybridForCausalLM`` folder without
``--trust-remote-code``. :mod:`hybridlm.serve.mapping` (which layers vLLM can run, the weight mapping) needs no
vLLM; :mod:`hybridlm.serve.model` and :mod:`hybridlm.serve.plugin` import it. docs/generation.md, "Serving with
vLLM", says what is supported.
"""
