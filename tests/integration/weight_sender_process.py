"""A trainer's weight sender alone in a process, for tests that kill it mid-transfer
(tests/integration/test_weight_sync_paths.py).

    python tests/integration/weight_sender_process.py MODEL_DIR URL_FILE BUCKET_BYTES TIMEOUT_S

Holds MODEL_DIR's weights as policy version 1, serves the sender's HTTP API on a free
loopback port, writes its URL to URL_FILE, and runs until killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> None:
    model_dir, url_file, bucket_bytes, timeout_s = sys.argv[1:5]
    import torch
    from safetensors.torch import load_file

    from sluice.tasks.train.sender import WeightSender

    sender = WeightSender(
        dtype=torch.float32, bucket_bytes=int(bucket_bytes), group_timeout_s=float(timeout_s)
    )
    url = sender.start()
    sender.offer(1, load_file(str(Path(model_dir) / "model.safetensors")))
    partial = Path(url_file + ".partial")
    partial.write_text(url)
    partial.rename(url_file)  # the test never reads half a URL
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
