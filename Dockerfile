# Image for the projector / CLI service of docker-compose.yml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ledger ledger
COPY schemas schemas
COPY benchmarks benchmarks
RUN pip install --no-cache-dir .
ENTRYPOINT ["ledger"]
