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

.PHONY: demo test test-fast install msgs models models-memory models-belief models-long models-quick clean help

help:
	@echo "make demo  [ARGS='...']  the closed loop on the embedded default models, e.g."
	@echo "           ARGS='--scenario red-chair --mode ar --link go2-paper'  (edgespec-demo --help)"
	@echo "           ARGS='--compare'  the one-frame AR vs SD comparison"
	@echo "make test               run the test suite on every core (what CI runs; TEST_WORKERS=1 runs it serially)"
	@echo "make test-fast          the unit tests only (-m 'not slow': no ROS graphs, benches, Ray, training)"
	@echo "make models             retrain the embedded default models (~80 min on 2 CPU cores)"
	@echo "make models-belief      the committed pair's recipe: memory 2, the search belief, the blocked-move expert,"
	@echo "                        19,014 target steps (~3 h): resumable, run it again to carry on"
	@echo "make models-memory      the memory pair's recipe (committed before the belief; ~2 h, resumable)"
	@echo "                        into build/train-memory/models"
	@echo "make models-long        the long recipe (~4x the target's steps, hours): resumable, run it again to carry on"
	@echo "make models-quick       the same pipeline in a few minutes on a sliver of the data (smoke run)"

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

models: install
	$(VENV)/bin/edgespec-train all --out edgespec_ros/models $(ARGS)

# The memory pair's recipe (docs/models.md: "The stop gap, committed"), committed before the search belief;
# writes build/train-memory/models (not the package) unless MODELS_OUT says so
models-memory: install
	$(VENV)/bin/edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --expert stop_gap_m=0.3 \
		--target-steps 9507 --target-budget-s 0 --exit-steps 2000 --work build/train-memory --resume \
		--out $(or $(MODELS_OUT),build/train-memory/models) $(ARGS)

# The committed pair's recipe (docs/models.md: "The search belief"): the memory recipe, and the prompt shows
# the search belief, which the expert reads (search_belief: turn back to where the goal was last seen; walk
# on after a full circle) while half the data rollouts begin with a spin; the expert reads the memory's
# blocked moves too (blocked_memory: turn away, then walk past, never push again) and a blocked move is
# pushed again half the time; 19,014 target steps. Writes the package's models unless MODELS_OUT says otherwise
models-belief: install
	$(VENV)/bin/edgespec-train all --memory 2 --memory-noise 0.15 --memory-dropout 0.5 --belief true \
		--spin-starts 0.5 --push-repeats 0.5 --expert "stop_gap_m=0.3;search_belief=true;blocked_memory=true" \
		--target-steps 19014 --target-budget-s 0 --exit-steps 2000 --work build/train-belief --resume \
		--out $(or $(MODELS_OUT),edgespec_ros/models) $(ARGS)

models-long: install
	$(VENV)/bin/edgespec-train all --long --resume --out edgespec_ros/models $(ARGS)

models-quick: install
	$(VENV)/bin/edgespec-train all --quick $(ARGS)

clean:
	rm -rf build edgespec_ros.egg-info $(VENV)/.pkg-stamp $(VENV)/.msgs-stamp
