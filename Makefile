# Two commands for a fresh machine:  make demo   |   make test
# Both bootstrap .venv (Python 3.11) on first use: pinned deps, the msg/ build, the package.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEPS   := $(VENV)/.deps-stamp
SRC    := $(shell find edgespec_ros -name '*.py' -o -name '*.json' 2>/dev/null) setup.py \
          $(wildcard config/* launch/*)
# scripts/nodes/* is globbed when cmake configures: a new launcher needs the full msgs build.
MSGS   := $(wildcard msg/*.msg action/*.action) CMakeLists.txt package.xml scripts/build_msgs.sh $(wildcard scripts/nodes/*)

.PHONY: demo test test-fast install msgs models models-memory models-belief models-settle models-long models-quick models-install clean help

help:
	@echo "make demo  [ARGS='...']  the closed loop on the embedded default models, e.g."
	@echo "           ARGS='--scenario red-chair --mode ar --link go2-paper'  (edgespec-demo --help)"
	@echo "           ARGS='--compare'  the one-frame AR vs SD comparison"
	@echo "make test               run the test suite on every core (what CI runs; TEST_WORKERS=1 runs it serially)"
	@echo "make test-fast          the unit tests only (-m 'not slow': no ROS graphs, benches, Ray, training)"
	@echo "Training writes under build/ and never touches the committed pair (MODELS_OUT=DIR to choose):"
	@echo "make models-belief      the committed pair's recipe: memory 2, the search belief, the blocked-move expert,"
	@echo "                        19,014 target steps (~3 h; resumable, run it again to carry on): build/train-belief/models"
	@echo "make models-settle      the committed target (BASE=...) continued 3,600 steps with settling, close-ups and"
	@echo "                        frames in motion, its draft and heads again (~1 h, resumable): build/train-settle/models"
	@echo "make models-memory      the memory pair's recipe (~2 h, resumable): build/train-memory/models"
	@echo "make models             the memoryless recipe (~89 min on 2 CPU cores): build/train/models"
	@echo "make models-long        the memoryless recipe at ~4x the target's steps (hours, resumable): build/train-long/models"
	@echo "make models-quick       the same pipeline in a few minutes on a sliver of the data (smoke run)"
	@echo "make models-install FROM=DIR  install a trained pair as the package's models (replaces the committed pair)"

$(DEPS): requirements/dev.txt requirements/msgs-build.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements/dev.txt -r requirements/msgs-build.txt
	touch $@

$(VENV)/.msgs-stamp: $(DEPS) $(MSGS)
	scripts/build_msgs.sh $(VENV)
	touch $@

# setuptools builds in-tree (build/lib) and never prunes it: a deleted module would be installed
# again from there, so drop its leftovers first (build/msgs is the cmake build, kept).
$(VENV)/.pkg-stamp: $(DEPS) $(SRC) $(VENV)/.msgs-stamp
	rm -rf build/lib build/bdist.*
	$(PIP) install -q --no-deps --no-build-isolation .
	scripts/build_msgs.sh $(VENV) --install-only
	touch $@

install: $(VENV)/.pkg-stamp

demo: install
	$(VENV)/bin/edgespec-demo $(ARGS)

# One worker per core; a file's tests stay on one worker (its module fixtures are built once).
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: install
	$(VENV)/bin/pytest $(XDIST) $(ARGS)

test-fast: install
	$(VENV)/bin/pytest $(XDIST) -m "not slow" $(ARGS)

# Every training target writes under build/ (MODELS_OUT overrides); `make models-install FROM=...` is the one
# step that puts a trained pair in the package, over the committed one.
models: install
	$(VENV)/bin/edgespec-train all --work build/train --out $(or $(MODELS_OUT),build/train/models) $(ARGS)

# The memory pair's recipe (docs/models.md: "The policy memory"), committed before the search belief;
# writes build/train-memory/models (not the package) unless MODELS_OUT says so
models-memory: install
	$(VENV)/bin/edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --expert stop_gap_m=0.3 \
		--target-steps 9507 --target-budget-s 0 --exit-steps 2000 --work build/train-memory --resume \
		--out $(or $(MODELS_OUT),build/train-memory/models) $(ARGS)

# The committed pair's recipe (docs/models.md: "The search belief"): the memory recipe, and the prompt shows
# the search belief, which the expert reads (search_belief: turn back to where the goal was last seen; walk
# on after a full circle) while half the data rollouts begin with a spin; the expert reads the memory's
# blocked moves too (blocked_memory: turn away, then walk past, never push again) and a blocked move is
# pushed again half the time; 19,014 target steps. Writes build/train-belief/models unless MODELS_OUT says so
models-belief: install
	$(VENV)/bin/edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --belief true \
		--spin-starts 0.5 --push-repeats 0.5 --expert "stop_gap_m=0.3;search_belief=true;blocked_memory=true" \
		--target-steps 19014 --target-budget-s 0 --exit-steps 2000 --work build/train-belief --resume \
		--out $(or $(MODELS_OUT),build/train-belief/models) $(ARGS)

# A continuation of a belief pair's target (BASE, default the committed one, which `make models-belief`
# reproduces; docs/models.md: "Settling, close-ups and frames in motion"): 3,600 steps at lr 1e-3 on the
# belief recipe's data with frames captured late in a motion (--mid-motion 1 --mid-motion-from 0.5), two
# close-ups a scenario (look-alikes of the goal first) and an expert that settles after a left/right
# reversal (settle_turns); the draft, distillation and heads trained again. Writes build/train-settle/models
BASE ?= edgespec_ros/models/target
models-settle: install
	$(VENV)/bin/edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --belief true \
		--spin-starts 0.5 --push-repeats 0.5 \
		--expert "stop_gap_m=0.3;search_belief=true;blocked_memory=true;settle_turns=true" \
		--mid-motion 1 --mid-motion-from 0.5 --closeups-per-scenario 2 --target-init $(BASE) --target-lr 0.001 \
		--target-steps 3600 --target-budget-s 0 --exit-steps 2000 --work build/train-settle --resume \
		--out $(or $(MODELS_OUT),build/train-settle/models) $(ARGS)

models-long: install
	$(VENV)/bin/edgespec-train all --long --resume --work build/train-long \
		--out $(or $(MODELS_OUT),build/train-long/models) $(ARGS)

# Install a finished pair (its card written) as the package's models, replacing the committed pair.
PAIR_FILES := draft/config.json draft/model.safetensors target/config.json target/model.safetensors README.md metrics.json
models-install:
	@test -n "$(FROM)" || { echo "usage: make models-install FROM=build/train-belief/models (a trained pair's directory)" >&2; exit 2; }
	@for f in $(PAIR_FILES); do test -f "$(FROM)/$$f" || { \
		echo "models-install: $(FROM)/$$f is missing: not a finished pair (edgespec-train all writes it last)" >&2; exit 2; }; done
	rm -rf edgespec_ros/models/draft edgespec_ros/models/target
	cp -r "$(FROM)/draft" "$(FROM)/target" edgespec_ros/models/
	cp "$(FROM)/README.md" "$(FROM)/metrics.json" edgespec_ros/models/
	if [ -f "$(FROM)/pipeline.json" ]; then cp "$(FROM)/pipeline.json" edgespec_ros/models/; fi

models-quick: install
	$(VENV)/bin/edgespec-train all --quick $(ARGS)

clean:
	rm -rf build edgespec_ros.egg-info $(VENV)/.pkg-stamp $(VENV)/.msgs-stamp
