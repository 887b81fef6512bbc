"""Prints the URL of a package's source distribution on the index pip is configured for.

Usage: sdist_url.py NAME VERSION. Used by test.sh to fetch vLLM 0.33.0's sources (the sdist
ships the Python modules the tests load; the wheel would be 400 MB).
"""

import sys

from pip._internal.commands import create_command


def main() -> None:
    name, version = sys.argv[1], sys.argv[2]
    download = create_command("download")
    options, _ = download.parse_args(["--no-binary=:all:", f"{name}=={version}"])
    with download.main_context():
        session = download.get_default_session(options)
        finder = download._build_package_finder(options, session, target_python=None, ignore_requires_python=True)
        urls = [
            c.link.url.split("#")[0]
            for c in finder.find_all_candidates(name)
            if str(c.version) == version and c.link.filename.endswith(".tar.gz")
        ]
    if not urls:
        sys.exit(f"sdist_url.py: no source distribution of {name} {version} on the index")
    print(urls[0])


if __name__ == "__main__":
    main()
