"""`python -m blazar.engine.probe`: what this host's llama.cpp build can do, as one line
of JSON on stdout (`{"gpuOffload": true}`), for the daemon, which never loads llama.cpp
itself (`blazar.enginehost.offload`).

`gpuOffload`: llama.cpp was built with a backend that can hold a model's layers off the
CPU (CUDA, Metal, Vulkan, ...). Without one, llama.cpp takes `n_gpu_layers` and runs
every layer on the CPU all the same.
"""

from __future__ import annotations

import json


def main() -> None:
    import llama_cpp

    print(json.dumps({"gpuOffload": bool(llama_cpp.llama_supports_gpu_offload())}))


if __name__ == "__main__":
    main()
