# pdserve — a thin wrapper over CMake. `make run` and `make test` do all set-up.
BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
MODEL      ?= models/small
PRESET     ?= small
PORT       ?= 8000
# the download cache (tokenizer, deps stamp): $PD_CACHE_DIR when set, as the
# binaries and tests read it, else .cache/ here
CACHE      := $(abspath $(or $(PD_CACHE_DIR),$(CURDIR)/.cache))
DEPS_STAMP := $(CACHE)/deps.stamp
TOKENIZER  := $(CACHE)/tokenizer-deepseek_v3/tokenizer.json

FUZZ_SECONDS ?= 60
BUILD_FUZZ ?= build-fuzz

.PHONY: all build deps run generate test test-asan model clean fuzz

all: build

$(DEPS_STAMP): deploy/install-deps.sh
	./deploy/install-deps.sh
	@mkdir -p $(CACHE) && touch $@

$(TOKENIZER): $(DEPS_STAMP)
	./deploy/fetch-tokenizer.sh $(CACHE) >/dev/null

deps: $(DEPS_STAMP) $(TOKENIZER)

build: deps
	@cmake -S . -B $(BUILD) -DPD_CACHE_DIR=$(CACHE) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

$(MODEL)/config.json: | build
	$(BUILD)/pdserve mkmodel --preset $(PRESET) --seed 1 --out $(MODEL) \
		--tokenizer-dir $(dir $(TOKENIZER))

model: build $(MODEL)/config.json

# the whole stack on this host: a gateway on http://127.0.0.1:8000, one
# prefill and one decode replica (Ctrl-C stops everything)
run: model
	$(BUILD)/pdserve up --model $(MODEL) --host 127.0.0.1 --port $(PORT)

# the model in-process, no services
generate: model
	$(BUILD)/pdserve generate --model $(MODEL) --chat --prompt "Hello! Who are you?" -n 32

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	$(MAKE) test-asan

test-asan: deps
	@cmake -S . -B $(BUILD_ASAN) -DPD_SANITIZE=ON -DPD_CUDA=OFF -DPD_CACHE_DIR=$(CACHE) >/dev/null
	cmake --build $(BUILD_ASAN) -j $(JOBS)
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS)

# libFuzzer harnesses (tests/fuzz/, clang): each runs FUZZ_SECONDS
fuzz: deps
	FUZZ_SECONDS=$(FUZZ_SECONDS) BUILD_FUZZ=$(BUILD_FUZZ) PD_CACHE_DIR=$(CACHE) JOBS=$(JOBS) \
		sh tests/fuzz/run.sh

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
