# The chkq image: workers, Flower and the chkq command line (see compose.yaml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Workers run as this user: give it write access to the run directories
# (build with --build-arg CHKQ_UID=$(id -u) to match the simulations' owner).
ARG CHKQ_UID=1000
ARG CHKQ_GID=1000
# /runs exists in the image, owned by that user: a named volume mounted there (compose's
# "runs") starts as a copy of it, so workers can write outputs into it.
RUN groupadd --gid "${CHKQ_GID}" chkq \
    && useradd --uid "${CHKQ_UID}" --gid "${CHKQ_GID}" --create-home --shell /usr/sbin/nologin chkq \
    && install -d -o chkq -g chkq -m 0775 /runs

WORKDIR /opt/chkq
COPY pyproject.toml README.md ./
COPY chkq ./chkq
COPY config ./config
COPY tasks ./tasks
COPY workers ./workers
RUN pip install . && chkq --version

USER chkq
WORKDIR /home/chkq
ENTRYPOINT ["chkq"]
CMD ["worker"]
