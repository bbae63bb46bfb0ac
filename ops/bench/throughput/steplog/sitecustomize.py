"""Step timeline of every process that runs an LLMEngine (the in-process engine, `ferry up`'s worker):
put this folder first on PYTHONPATH and set FERRY_STEPLOG=<prefix>; each process appends one line per
engine step to <prefix>.<pid>: start (unix s), wall s, engine-thread CPU s, outputs, sequences,
prefill tokens, thread name. `steplog.py <files>` sums them per step class and the gaps between steps.
A profiling aid (ops only): it wraps LLMEngine.step when ferry.engine.llm_engine is first imported.

    PYTHONPATH=ops/bench/throughput/steplog:$PYTHONPATH FERRY_STEPLOG=/tmp/sl/up python ops/bench/throughput/spy.py ...
"""

import os

_PREFIX = os.environ.get("FERRY_STEPLOG")

if _PREFIX:
    import importlib.abc
    import importlib.util
    import sys
    import threading
    import time

    def _wrap(module) -> None:
        step = module.LLMEngine.step
        log = open(f"{_PREFIX}.{os.getpid()}", "a", buffering=1)  # open for the process's life

        def logged_step(self):
            started, cpu = time.time(), time.thread_time()
            outputs = step(self)
            s = self.last_step
            if outputs or s is not None:
                wall, cpu = time.time() - started, time.thread_time() - cpu
                seqs, prefill = (s.num_seqs, s.num_prefill_tokens) if s is not None else (-1, -1)
                name = threading.current_thread().name
                log.write(f"{started:.6f} {wall:.6f} {cpu:.6f} {len(outputs)} {seqs} {prefill} {name}\n")
            return outputs

        module.LLMEngine.step = logged_step

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "ferry.engine.llm_engine":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):
                exec_module(module)
                _wrap(module)

            spec.loader.exec_module = exec_and_wrap
            return spec

    sys.meta_path.insert(0, _Finder())
