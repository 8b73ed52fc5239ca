"""From the lowered module to the artifact: target resolution (``target.py``), the CPU and GPU
schedules, device-kernel records, the flat program, the tokenizer file, the memory plan, the
artifact writer and the device toolchain step (``finish.py``)."""
