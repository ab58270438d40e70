#!/usr/bin/env bash
# Makes docs/images/tensorboard.png: the README's TensorBoard screenshot, of a real `tensorboard` server showing
# what `python -m tf_sharded train` wrote. Needs the repository's .venv (`make .venv/.installed`) and Debian's
# `chromium` (apt-get install chromium). Run from the repository root: bash docs/images/tensorboard.sh
set -euo pipefail
work=$(mktemp -d)
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
# Raw-key tables under the default strategy (a local parameter-server cluster): live keys grow as keys arrive.
.venv/bin/python -m tf_sharded train --vocabulary dynamic --steps 1200 --steps_per_epoch 400 \
  --metrics_every 40 --checkpoint_dir "$work/ckpt" --verbose 0
port=$(.venv/bin/python -c "import portpicker; print(portpicker.pick_unused_port())")
.venv/bin/tensorboard --logdir "$work/ckpt/logs" --host 127.0.0.1 --port "$port" >"$work/tensorboard.log" 2>&1 &
server=$!
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$port/data/plugin/scalars/tags" | grep -q tables && break
  sleep 1
done
# The scalars dashboard (its charts are SVG; the time-series dashboard's WebGL draws nothing headless), filtered
# to a small and a large table's live keys and shard balance (largest shard over mean).
filter=$(.venv/bin/python -c "import urllib.parse; print(urllib.parse.quote('tables/embeddings/C(1|3)/(rows|shard_load)', safe=''))")
chromium --headless --no-sandbox --hide-scrollbars --window-size=1600,1000 --virtual-time-budget=30000 \
  --screenshot="$work/shot.png" "http://127.0.0.1:$port/#scalars&tagFilter=$filter"
cp "$work/shot.png" docs/images/tensorboard.png
echo "wrote docs/images/tensorboard.png"
