# `make demo` and `make test` set up .venv themselves (pinned versions, CPU torch).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attncomp-installed
JOBS   ?= 2

.PHONY: demo test test-full zoo zoo-decode zoo-newest test-gpu test-gpu-dist test-newest test-oldest venv clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (torch==2.13.0 CPU, pinned dependencies)..."
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# pytest exits 5 when it collects no test: make fails on that like on any other failure.
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --durations=10 tests

# Every case of every list: the tests marked @pytest.mark.sample(n), of which make test runs n, run them all
# (the kernel interpreter's combinatorial lists, the Hugging Face populations); not timed yet.
test-full: $(STAMP)
	ATTNCOMP_TEST_FULL=1 $(PY) -m pytest -q -n $(JOBS) --durations=10 tests

# The registry sweep: a tiny random-weight model of every causal-LM, masked-LM, seq2seq-LM and image-classification
# family of the installed transformers, compiled and compared with eager, each in its own process (JOBS at a
# time); writes tests/zoo/results.json and tests/zoo/RESULTS.md. ZOO_ARGS passes more, e.g. --families llama,bert.
# Then the curated family tests with every case (ATTNCOMP_TEST_FULL=1; make test runs a sample of each list).
zoo: $(STAMP)
	$(PY) -m tests.zoo --jobs $(JOBS) $(ZOO_ARGS)
	ATTNCOMP_TEST_FULL=1 $(PY) -m pytest -q -n $(JOBS) tests/e2e/test_hf_families.py tests/e2e/test_models.py \
		tests/zoo/test_zoo_sample.py

# On a GPU machine, with its own Python (torch and triton installed there): the GPU tests in their own
# process (the CPU kernel tests switch Triton to its interpreter when imported).
test-gpu:
	python3 -m pytest -q -m gpu tests/codegen/test_triton_gpu.py tests/codegen/test_scfa_gpu.py tests/codegen/test_template_gpu.py tests/codegen/test_spion_stats_gpu.py tests/e2e/test_gpu_models.py tests/test_ops.py tests/codegen/test_hopper_gpu.py

# On a machine with 2 GPUs: context-parallel attention over NCCL against one GPU (the thread-ring
# checks need only one).
test-gpu-dist:
	python3 -m pytest -q -m gpu tests/distributed/test_context_parallel_gpu.py tests/distributed/test_thread_ring.py

clean:
	rm -rf $(VENV) $(NEWEST) $(OLDEST) .pytest_cache

# The newest releases that pyproject.toml admits (torch <2.14 is the pinned 2.13.0; triton and
# transformers unpinned): the kernel interpreter's layout and dQ tests (Triton's newest interpreter) and the sample of
# Hugging Face families, in a second venv.
NEWEST := .venv-newest
$(NEWEST)/.stamp: pyproject.toml
	@test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(NEWEST)/bin/python -m pip install -q --disable-pip-version-check -U "triton>=3.5" "transformers>=5.17" \
		numpy networkx safetensors pytest pytest-xdist
	$(NEWEST)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $@

# The registry sweep with the newest transformers the ranges admit: tests/zoo/results-newest.json and RESULTS-newest.md.
# every causal LM decoding into an initialised static cache (dense, against eager) and under the sparse policies
# (steps against its full forward): tests/zoo/RESULTS-decode.md
zoo-decode: $(STAMP)
	$(PY) -m tests.zoo --jobs $(JOBS) --registry causal-lm --decode static,dfss,hash,drop --timeout 900 --out decode $(ZOO_ARGS)

zoo-newest: $(NEWEST)/.stamp
	$(NEWEST)/bin/python -m tests.zoo --jobs $(JOBS) --out newest $(ZOO_ARGS)

test-newest: $(NEWEST)/.stamp
	$(NEWEST)/bin/python -c "import torch, triton, transformers; print('newest admitted:', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
	$(NEWEST)/bin/python -m pytest -q -n $(JOBS) tests/codegen/test_template_layout.py tests/codegen/test_dq_atomic.py \
		tests/e2e/test_hf_families.py -k "not generate or llama or gpt2"

# The oldest releases that pyproject.toml admits (torch 2.11 with the triton it requires, the test extra's
# transformers 5.17, numpy 1.26, networkx 3.2, safetensors 0.8; torch 2.11 on PyPI is a CUDA build, a larger
# download): the op, the functional API, Inductor around the op, packages and the Hugging Face families, in a
# third venv (its triton, 3.6, is the pinned one: make test runs the kernel interpreter with it). The GPU machines run torch 2.11 too. Left out: the encoder-decoder
# families (t5, bart, whisper). Their outputs match, but with Inductor off (as the tests run) torch 2.11's
# dynamo compiles the decoder frames resumed after a graph break (transformers' config deepcopy) once more
# for a new batch size ("encoder_hidden_states size mismatch at index 0"), then marks that dim dynamic;
# with Inductor on (the default) no new graph is compiled.
OLDEST := .venv-oldest
$(OLDEST)/.stamp: pyproject.toml
	@test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --disable-pip-version-check torch==2.11.0 "transformers==5.17.0" \
		"numpy==1.26.4" "networkx==3.2.1" "safetensors==0.8.0" pytest pytest-xdist
	$(OLDEST)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $@

test-oldest: $(OLDEST)/.stamp
	$(OLDEST)/bin/python -c "import torch, triton, transformers, numpy; print('oldest admitted:', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
	$(OLDEST)/bin/python -m pytest -q -n $(JOBS) tests/e2e/test_hf_families.py \
		tests/e2e/test_inductor.py tests/runtime/test_package.py tests/test_functional.py tests/test_ops.py \
		-k "not t5 and not bart and not whisper"
