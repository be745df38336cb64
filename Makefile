# The course's tasks. `make lab` and `make test` set everything up on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CUDA 13 driver gets the cu13 wheels; a CUDA 12 driver, or no GPU at all, the cu12 ones (their NVRTC
# compiles the course's CUDA C even without a GPU).
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1)
CUDA_EXTRA := $(if $(filter 13 14 15 16,$(CUDA_MAJOR)),cu13,cu12)
# The tests run on every core (pytest-xdist), at most 4 at once (each holds TensorFlow: about 2 GB); PARALLEL= runs
# them in one process. make test keeps each test file (each class) to one worker, so that a fixture its tests share
# (a class of graded notebooks, the JupyterHub and its users) is built once (--dist loadscope; pytest-xdist 3.8's
# loadgroup does not group under pytest 9, whose node ids it cannot rename), handing out the longest files first
# (--no-loadscope-reorder keeps the order tests/conftest.py gives them); make test-fast's shared fixtures take
# seconds, so its tests go to whichever worker is free.
PARALLEL ?= -n auto --maxprocesses 4
# make matrix CC="8.0 native": the compute capabilities (make's own CC, the C compiler, counts only when given so)
MATRIX_CC := $(if $(filter command line,$(origin CC)),$(CC))

.PHONY: setup lab test test-fast check-records notebooks matrix record exercises check-exercises grade grade-class hub release-feedback probe clean

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; sys.exit(0 if (3, 11) <= v <= (3, 12) else \
	  f"the course needs Python 3.11 or 3.12, and {sys.executable} is {v[0]}.{v[1]}: run make PYTHON=python3.12 ...")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e ".[$(CUDA_EXTRA),test]"
	touch $@

setup: $(BIN)/.installed                ## create .venv with everything the course needs

lab: setup                              ## open the course in JupyterLab (options: make lab ARGS=--no-browser)
	$(BIN)/python -m gpucourse lab $(ARGS)

test: setup                             ## run the whole test suite (CPU mode without a GPU): what CI runs
	$(BIN)/python -m pytest $(PARALLEL) $(if $(PARALLEL),--dist loadscope --no-loadscope-reorder)

test-fast: setup                        ## the unit tests alone, for day-to-day work (no notebooks, grading, hub, archs, records)
	$(BIN)/python -m pytest -q -m "not slow and not records and not archs" $(PARALLEL)

check-records: setup                    ## check the committed GPU records in results/
	$(BIN)/python -m gpucourse check-records

.PHONY: results
results: setup                          ## write RESULTS.md from the records in results/ (check: python -m gpucourse results --check)
	$(BIN)/python -m gpucourse results

probe: setup                            ## GPU or CPU mode, what the GPU is, which lesson steps it runs
	$(BIN)/python -m gpucourse probe

notebooks: setup                        ## execute every lesson and solution notebook, print a summary
	$(BIN)/python -m gpucourse run

matrix: setup                          ## on a GPU: every notebook at compute capability 7.5, 8.0, 8.6, 8.9 and natively: pass/FAIL, seconds (CC="8.0 native" NB=... JOBS=2 SAVE=dir)
	$(BIN)/python -m gpucourse matrix $(if $(MATRIX_CC),--cc $(MATRIX_CC)) $(if $(JOBS),--jobs $(JOBS)) $(if $(SAVE),--save $(SAVE)) $(NB)

record: setup                           ## on a GPU: record every lesson's figures in results/
	$(BIN)/python -m gpucourse record

exercises: setup                        ## regenerate exercises/ from solutions/
	$(BIN)/python -m gpucourse exercises

check-exercises: setup                  ## fail if exercises/ differs from what solutions/ generates
	$(BIN)/python -m gpucourse exercises --check

grade: setup                            ## grade one notebook: make grade NB=exercises/01_vector_multiply/vector_multiply.ipynb
	$(BIN)/python -m gpucourse grade $(NB)

grade-class: setup                      ## grade a class: make grade-class DIR=submitted (DIR/<student>/<lesson>/<notebook>.ipynb)
	$(BIN)/python -m gpucourse grade-class $(DIR)

hub: setup                              ## as root: a JupyterHub for a class: make hub INSTRUCTOR=teacher STUDENTS="ann bo" (Ctrl-C stops it)
	$(BIN)/python -m gpucourse hub $(if $(INSTRUCTOR),--instructor $(INSTRUCTOR)) --students "$(STUDENTS)" $(ARGS)

release-feedback: setup                 ## after grade-class: make release-feedback LESSON=01_vector_multiply (students fetch their own)
	$(BIN)/python -m gpucourse release-feedback $(LESSON)

clean:
	rm -rf $(VENV) .pytest_cache .grading
