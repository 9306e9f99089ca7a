# tokenfleet-base:bookworm (local-images.sh): Debian's Python 3.11 as python:3.11-slim offers it, plus torch when
# the build context holds its wheel (the image registry being out of reach, so may be PyTorch's index).
FROM tokenfleet-rootfs:bookworm
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    LANG=C.UTF-8
RUN python3 -m venv /opt/venv && pip install -q --upgrade pip
COPY wheels/ /tmp/wheels/
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install -q /tmp/wheels/*.whl; fi && rm -rf /tmp/wheels /root/.cache
CMD ["python3"]
