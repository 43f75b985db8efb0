"""LoRA adapters served beside their base model (vLLM's `--enable-lora` interface).

- `request.py`: `LoRARequest` (name, integer id, PEFT folder), what a request names its adapter with;
- `peft.py`: reads a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) onto this model's
  layers, checked against their shapes, `max_lora_rank` and the targets Pagoda adapts;
- `layers.py`: each adapted linear layer's adapters in `max_loras` device slots, and the step's
  per-token adapter mapping applied on top of the base matmul (a PyTorch reference path); an encoder's
  layers (`--enable-tower-connector-lora`) read a mapping written per encoder call instead;
- `manager.py`: the worker's adapters: loaded ones kept on the host (LRU, `max_cpu_loras`), the step's
  ones placed in slots.
"""
