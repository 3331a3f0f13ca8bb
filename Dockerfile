# The application image: installs exactly as the README does (`make setup`), with the jars baked in so
# containers start without network access, the local file system compiled (a JDK, for its javac) and the JVM's
# class archive, so that their Spark starts sooner and writes without child processes.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven make \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
ENV IOTMON_CACHE_DIR=/opt/iotmon/cache \
    IOTMON_HOME=/data
RUN make setup PYTHON=python3.11 VENV=/opt/iotmon/venv
ENV PATH=/opt/iotmon/venv/bin:$PATH

ENTRYPOINT ["iotmon"]
CMD ["--help"]
