# Two entry points for a fresh machine: `make run` and `make test` (see README).
# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.foretell-installed

.PHONY: setup setup-cuda run test bench package clean

setup: $(STAMP)

# torch first, pinned to the local CPU wheel, so no dependency can pull a CUDA build.
$(STAMP): pyproject.toml setup.py $(wildcard engine/native/*.c engine/native/*.h) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[test]"
	touch $(STAMP)

# NVIDIA GPUs, from source: the same .venv with PyTorch's CUDA build of torch 2.13.0 and Triton 3.7.1 (the
# quantized GPU kernels, engine/ops/triton_q.py). Needs download.pytorch.org and an NVIDIA driver for CUDA 12.8+;
# afterwards `make run` starts the app with the GPU controls enabled. TORCH_CUDA_INDEX picks another CUDA variant.
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
setup-cuda:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==2.13.0" --index-url $(TORCH_CUDA_INDEX)
	$(PIP) install "triton==3.7.1" -e ".[test]"
	$(PY) -c "from engine.metrics import cuda_status; ok, why = cuda_status(); print('CUDA:', 'usable' if ok else 'NOT usable', why)"
	touch $(STAMP)

# The desktop app on the embedded default model (resources/models/).
run: setup
	$(VENV)/bin/foretell

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/quant.py
	$(PY) bench/tokenizer.py
	$(PY) bench/default_model_eval.py --threads 1
	$(PY) bench/mtp.py
	$(PY) bench/report.py

# The Linux packages (.deb and portable .tar.gz) in dist/: see packaging/README.md.
package: setup
	PYTHON=$(PY) bash packaging/build.sh

clean:
	rm -rf $(VENV) build dist
